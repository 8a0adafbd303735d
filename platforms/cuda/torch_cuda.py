"""`TorchCudaPlatform`: the device queries a GPU platform makes through torch.cuda.

CUDA and ROCm builds of torch expose the same `torch.cuda` API (HIP devices are "cuda"
devices there), so the cuda and rocm platforms share these and differ only in their
probe, capabilities and component names.
"""

from __future__ import annotations

import torch

from portaserve.framework.interfaces import Platform

from .graphs import CUDA_GRAPHS, TorchCudaGraphs


class TorchCudaPlatform(Platform):
    """Device queries, worker setup and graph capture through `torch.cuda`."""

    device_type = "cuda"
    ray_resource = "GPU"

    def preferred_attention_backends(self) -> tuple[str, ...]:
        return ("triton",)

    def _torch_device(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank)

    def _memory_info(self, local_rank: int) -> tuple[int, int]:
        # Creates the device's context if it does not exist yet: fine after selection.
        free, total = torch.cuda.mem_get_info(local_rank)
        return int(free), int(total)

    def _init_worker(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def synchronize(self, local_rank: int = 0) -> None:
        torch.cuda.synchronize(local_rank)

    def graph_capture(self, compile_backend: str, local_rank: int = 0) -> TorchCudaGraphs | None:
        # CUDA graphs, and HIP graphs through the same API
        return TorchCudaGraphs(self.torch_device(local_rank)) if compile_backend == CUDA_GRAPHS else None

    def compute_units(self, local_rank: int = 0) -> int:
        # streaming multiprocessors (NVIDIA) or compute units (AMD)
        return int(torch.cuda.get_device_properties(self.torch_device(local_rank)).multi_processor_count)
