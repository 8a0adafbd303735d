"""CUDA graphs as the engine's `GraphCapture` (NVIDIA and ROCm builds of torch alike).

The cuda and rocm platforms name this "cudagraphs" in their `compile_backends` and return
a `TorchCudaGraphs` for that name from `Platform.graph_capture`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from portaserve.framework.interfaces.graph_capture import GraphCapture

#: The compile backend name that means "decode steps replayed from CUDA graphs".
CUDA_GRAPHS = "cudagraphs"


class TorchCudaGraphs(GraphCapture):
    """Capture through torch.cuda.CUDAGraph, every recording in one shared memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()
        return graph, out
