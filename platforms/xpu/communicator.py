"""Collectives between Intel GPU ranks: torch's built-in "xccl" backend, else oneCCL's "ccl".

torch >= 2.8 ships the xccl backend in its XPU builds. Older setups get collectives from
oneccl_bindings_for_pytorch, whose import registers a backend named "ccl"; the backend is
therefore decided when the communicator is built, not when this module is imported.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch.distributed as dist

from portaserve.framework.distributed import TorchDistributedCommunicator
from portaserve.framework.errors import PlatformUnavailableError


def xpu_dist_backend() -> str:
    """The torch.distributed backend to use for XPU collectives ("xccl" or "ccl")."""
    is_xccl = getattr(dist, "is_xccl_available", None)
    if is_xccl is not None and is_xccl():
        return "xccl"
    if importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None:
        importlib.import_module("oneccl_bindings_for_pytorch")  # registers the "ccl" backend
        return "ccl"
    raise PlatformUnavailableError(
        "xpu collectives need torch's xccl backend (an XPU build of torch >= 2.8) or "
        "oneccl_bindings_for_pytorch; neither is available"
    )


class XcclCommunicator(TorchDistributedCommunicator):
    name = "xccl"
    platforms = frozenset({"xpu"})
    dist_backend = "xccl"

    @classmethod
    def group_backend(cls) -> str:
        # asked only when a group is built (world size > 1, or a weight-update group)
        return xpu_dist_backend()
