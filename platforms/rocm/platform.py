"""RocmPlatform: AMD GPUs (Instinct, Radeon) through a HIP build of torch."""

from __future__ import annotations

import importlib.util

import torch

from portaserve.framework.interfaces import SCORE_ACCELERATOR, DeviceInfo, PlatformCapabilities, Unavailable
from portaserve.platforms.cuda.devices import summarize, visible_gpus
from portaserve.platforms.cuda.graphs import CUDA_GRAPHS
from portaserve.platforms.cuda.torch_cuda import TorchCudaPlatform

# gfx arch prefixes: MI300 (gfx94x) and MI350 (gfx950) have fp8 matrix cores; MI100 (gfx908)
# and later CDNA parts, and RDNA3/4 (gfx11xx/gfx12xx) have int8 ones; Vega (gfx900/gfx906)
# lacks bf16 arithmetic.
_FP8_ARCHS = ("gfx94", "gfx95")
# MI300's fp8 units use the "fnuz" variant of e4m3 (no negative zero, max 240); MI350 the OCP one.
_FP8_FNUZ_ARCHS = ("gfx94",)
_INT8_ARCHS = ("gfx908", "gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")
_NO_BF16_ARCHS = ("gfx900", "gfx906")


def gfx_arch(gcn_arch_name: str) -> str:
    """'gfx942:sramecc+:xnack-' -> 'gfx942' (the feature flags after ':' do not change capabilities)."""
    return gcn_arch_name.split(":", 1)[0].strip()


class RocmPlatform(TorchCudaPlatform):
    name = "rocm"
    # (device_type "cuda": HIP builds of torch address AMD GPUs as "cuda" devices)
    dist_backend = "nccl"

    @classmethod
    def probe(cls) -> DeviceInfo | Unavailable:
        """A HIP build of torch that sees at least one GPU; touches what cuda/devices.py lists."""
        if torch.version.hip is None:
            if torch.version.cuda is not None:
                return Unavailable(cls.name, f"torch {torch.__version__} is a CUDA build, not a ROCm (HIP) build")
            return Unavailable(cls.name, f"torch {torch.__version__} is built without ROCm (install a ROCm build of torch)")
        gpus = visible_gpus()
        if not gpus:
            return Unavailable(
                cls.name,
                f"torch.cuda.is_available() is False (HIP {torch.version.hip} build): no AMD GPU is visible"
                " (check rocm-smi, HIP_VISIBLE_DEVICES and membership of the render/video groups)",
            )
        archs = sorted({gfx_arch(g.gcn_arch_name) for g in gpus if g.gcn_arch_name})
        arch = archs[0] if len(archs) == 1 else None
        name, note = summarize(gpus)
        extra = {"hip": str(torch.version.hip), "compute_units": str(min(g.num_multiprocessors for g in gpus))}
        if len(archs) > 1:
            # Mixed architectures: claim only what every GPU can do (no arch-specific features).
            note = f"mixed gfx architectures {archs}; only common capabilities are declared"
        if note:
            extra["note"] = note
        return DeviceInfo(
            platform=cls.name,
            device_name=name,
            device_count=len(gpus),
            total_memory_bytes=min(g.total_memory_bytes for g in gpus),
            score=SCORE_ACCELERATOR,
            reason=f"{len(gpus)} AMD GPU(s) visible through torch {torch.__version__} (HIP {torch.version.hip})",
            capability=arch,
            extra=extra,
        )

    @property
    def gfx_arch(self) -> str:
        return self.info.capability or ""

    def capabilities(self) -> PlatformCapabilities:
        arch = self.gfx_arch
        dtypes = {torch.float32, torch.float16}
        kv_dtypes = {"auto"}
        features = set()
        if arch and not arch.startswith(_NO_BF16_ARCHS):
            dtypes.add(torch.bfloat16)
        if arch.startswith(_FP8_ARCHS):
            kv_dtypes.add("fp8")
            features.add("fp8_matmul")
            if arch.startswith(_FP8_FNUZ_ARCHS):
                features.add("fp8_e4m3fnuz")
        if arch.startswith(_INT8_ARCHS):
            features.add("int8_matmul")
        if importlib.util.find_spec("triton") is not None:
            features.add("triton")
        return PlatformCapabilities(
            dtypes=frozenset(dtypes),
            kv_cache_dtypes=frozenset(kv_dtypes),
            features=frozenset(features),
            compile_backends={"default": CUDA_GRAPHS, "max": "inductor"},
            graph_backends=frozenset({CUDA_GRAPHS}),
            default_compilation_mode="none",
            block_sizes=frozenset({16, 32, 64}),
            default_block_size=16,
        )

    def default_communicator(self) -> str:
        return "rccl"

    def default_kv_cache_allocator(self) -> str:
        return "rocm"
