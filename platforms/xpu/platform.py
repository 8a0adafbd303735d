"""XpuPlatform: Intel GPUs (Data Center GPU Max, Arc) through torch.xpu.

What the probe touches: ``torch.xpu.is_available()`` and ``device_count()`` (Level Zero
device enumeration through SYCL) and ``torch.xpu.get_device_properties(i)`` (static
properties; no queue or allocation is made). intel-extension-for-pytorch is looked up
with ``find_spec`` only, and imported in the probe just when this torch has no native
XPU support (torch < 2.4, where the extension provides ``torch.xpu``).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from portaserve.framework.interfaces import SCORE_ACCELERATOR, DeviceInfo, Platform, PlatformCapabilities, Unavailable

IPEX = "intel_extension_for_pytorch"


def _xpu_module():
    """torch.xpu, importing intel-extension-for-pytorch first when torch lacks a native one."""
    xpu = getattr(torch, "xpu", None)
    if xpu is None and importlib.util.find_spec(IPEX) is not None:
        importlib.import_module(IPEX)
        xpu = getattr(torch, "xpu", None)
    return xpu


class XpuPlatform(Platform):
    name = "xpu"
    device_type = "xpu"
    dist_backend = "xccl"
    # Ray schedules Intel GPUs as "GPU" (ONEAPI_DEVICE_SELECTOR narrows each actor to its own)
    ray_resource = "GPU"

    @classmethod
    def probe(cls) -> DeviceInfo | Unavailable:
        """torch.xpu sees at least one Intel GPU."""
        xpu = _xpu_module()
        if xpu is None:
            return Unavailable(cls.name, f"torch {torch.__version__} has no torch.xpu and intel-extension-for-pytorch is not installed")
        if not xpu.is_available():
            return Unavailable(
                cls.name,
                f"torch.xpu.is_available() is False (torch {torch.__version__}): no Intel GPU is visible or this"
                " torch build has no XPU support (install an XPU build of torch and the Level Zero driver)",
            )
        count = int(xpu.device_count())
        props = [xpu.get_device_properties(i) for i in range(count)]
        first = props[0]
        names = sorted({str(p.name) for p in props})
        ipex = importlib.util.find_spec(IPEX) is not None
        extra = {
            "driver": str(getattr(first, "driver_version", "")),
            "ipex": "installed" if ipex else "not installed",
            "fp16": str(all(getattr(p, "has_fp16", True) for p in props)),
            "bf16": str(all(getattr(p, "has_bfloat16_conversions", True) for p in props)),
            "xmx": str(all(getattr(p, "has_subgroup_matrix_multiply_accumulate", False) for p in props)),
        }
        if len(names) > 1:
            extra["note"] = f"mixed GPU models ({', '.join(names)}): capabilities are those of the least capable"
        xpu_version = getattr(torch.version, "xpu", None)
        return DeviceInfo(
            platform=cls.name,
            device_name=names[0],
            device_count=count,
            total_memory_bytes=min(int(p.total_memory) for p in props),
            score=SCORE_ACCELERATOR,
            reason=f"{count} Intel GPU(s) visible through torch.xpu (torch {torch.__version__}"
            + (f", XPU {xpu_version}" if xpu_version else "")
            + (", intel-extension-for-pytorch installed)" if ipex else ")"),
            capability=str(getattr(first, "architecture", "")) or None,
            extra=extra,
        )

    def capabilities(self) -> PlatformCapabilities:
        extra = self.info.extra
        dtypes = {torch.float32}
        if extra.get("fp16", "True") == "True":
            dtypes.add(torch.float16)
        if extra.get("bf16", "True") == "True":
            dtypes.add(torch.bfloat16)
        features = set()
        if extra.get("xmx") == "True":
            features.add("int8_matmul")
        if importlib.util.find_spec("triton") is not None:
            features.add("triton")
        if extra.get("ipex") == "installed":
            features.add("ipex")
        return PlatformCapabilities(
            dtypes=frozenset(dtypes),
            kv_cache_dtypes=frozenset({"auto"}),
            features=frozenset(features),
            compile_backends={"default": "inductor", "max": "inductor"},
            default_compilation_mode="none",
            block_sizes=frozenset({16, 32, 64}),
            default_block_size=16,
        )

    def preferred_attention_backends(self) -> tuple[str, ...]:
        return ("triton",)

    def default_communicator(self) -> str:
        return "xccl"

    def default_kv_cache_allocator(self) -> str:
        return "xpu"

    def _torch_device(self, local_rank: int) -> torch.device:
        return torch.device("xpu", local_rank)

    def _memory_info(self, local_rank: int) -> tuple[int, int]:
        xpu = _xpu_module()
        if hasattr(xpu, "mem_get_info"):
            free, total = xpu.mem_get_info(local_rank)
            return int(free), int(total)
        total = int(xpu.get_device_properties(local_rank).total_memory)
        return total - int(xpu.memory_reserved(local_rank)), total

    def _init_worker(self, local_rank: int) -> None:
        _xpu_module().set_device(local_rank)

    def synchronize(self, local_rank: int = 0) -> None:
        _xpu_module().synchronize(local_rank)

    def compute_units(self, local_rank: int = 0) -> int | None:
        # Xe-cores (subslices) where torch reports them, else SYCL's compute units
        props = _xpu_module().get_device_properties(self.torch_device(local_rank))
        units = getattr(props, "gpu_subslice_count", None) or getattr(props, "max_compute_units", None)
        return int(units) if units else None
