"""CudaPlatform: NVIDIA GPUs through a CUDA build of torch."""

from __future__ import annotations

import importlib.util

import torch

from portaserve.framework.interfaces import SCORE_ACCELERATOR, DeviceInfo, PlatformCapabilities, Unavailable

from .devices import summarize, visible_gpus
from .graphs import CUDA_GRAPHS
from .torch_cuda import TorchCudaPlatform

# Ampere (8.0) is the first architecture with bf16 tensor cores; Ada (8.9) and Hopper
# (9.0) add fp8 ones; Turing (7.5) has int8 (IMMA) tensor cores.
_BF16_MIN = (8, 0)
_FP8_MIN = (8, 9)
_INT8_MIN = (7, 5)


def parse_capability(capability: str) -> tuple[int, int]:
    major, _, minor = capability.partition(".")
    return int(major), int(minor or 0)


class CudaPlatform(TorchCudaPlatform):
    name = "cuda"
    dist_backend = "nccl"

    @classmethod
    def probe(cls) -> DeviceInfo | Unavailable:
        """A CUDA (not HIP) build of torch that sees at least one GPU; see devices.py for what is touched."""
        if torch.version.cuda is None:
            if torch.version.hip is not None:
                return Unavailable(cls.name, f"torch {torch.__version__} is a ROCm (HIP {torch.version.hip}) build; the rocm platform serves AMD GPUs")
            return Unavailable(cls.name, f"torch {torch.__version__} is built without CUDA (install a CUDA build of torch)")
        if torch.version.hip is not None:
            return Unavailable(cls.name, "torch reports both CUDA and HIP versions; the rocm platform serves HIP builds")
        gpus = visible_gpus()
        if not gpus:
            return Unavailable(
                cls.name,
                f"torch.cuda.is_available() is False (CUDA {torch.version.cuda} build): no NVIDIA GPU or driver is visible"
                " (check nvidia-smi and CUDA_VISIBLE_DEVICES)",
            )
        least = min(gpus, key=lambda g: (g.major, g.minor))
        name, note = summarize(gpus)
        capability = f"{least.major}.{least.minor}"
        reason = f"{len(gpus)} CUDA GPU(s) visible through torch {torch.__version__} (CUDA {torch.version.cuda})"
        extra = {"cuda": str(torch.version.cuda), "multiprocessors": str(least.num_multiprocessors)}
        if note:
            extra["note"] = note
        return DeviceInfo(
            platform=cls.name,
            device_name=name,
            device_count=len(gpus),
            total_memory_bytes=min(g.total_memory_bytes for g in gpus),
            score=SCORE_ACCELERATOR,
            reason=reason,
            capability=capability,
            extra=extra,
        )

    def compute_capability(self) -> tuple[int, int]:
        return parse_capability(self.info.capability or "0.0")

    def capabilities(self) -> PlatformCapabilities:
        cc = self.compute_capability()
        dtypes = {torch.float32, torch.float16}
        kv_dtypes = {"auto"}
        features = set()
        if cc >= _BF16_MIN:
            dtypes.add(torch.bfloat16)
        if cc >= _FP8_MIN:
            kv_dtypes.add("fp8")
            features.add("fp8_matmul")
        if cc >= _INT8_MIN:
            features.add("int8_matmul")
        if importlib.util.find_spec("triton") is not None:
            features.add("triton")
        return PlatformCapabilities(
            dtypes=frozenset(dtypes),
            kv_cache_dtypes=frozenset(kv_dtypes),
            features=frozenset(features),
            compile_backends={"default": CUDA_GRAPHS, "max": "inductor"},
            graph_backends=frozenset({CUDA_GRAPHS}),
            # Not measured on a GPU yet: eager until BENCHMARKS.md says otherwise.
            default_compilation_mode="none",
            block_sizes=frozenset({16, 32, 64}),
            default_block_size=16,
        )

    def default_communicator(self) -> str:
        return "nccl"

    def default_kv_cache_allocator(self) -> str:
        return "cuda"
