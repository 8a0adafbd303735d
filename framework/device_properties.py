"""What the platform says about this process's device, for code that sees only a tensor.

A kernel gets torch tensors and their `torch.device`, never the Platform object that
knows the device; sizing a grid needs the device's compute units (`Platform.compute_units`).
The worker publishes them here once it has set up its device (`publish`), and kernels
ask by device (`compute_units`). Nothing published (a kernel called directly in a test,
the Triton interpreter on a CPU): None, and the kernel picks its own default.
"""

from __future__ import annotations

import torch

from .interfaces import Platform

_COMPUTE_UNITS: dict[torch.device, int] = {}


def publish(platform: Platform, local_rank: int = 0) -> None:
    """Record what `platform` reports about the device of `local_rank` in this process."""
    units = platform.compute_units(local_rank)
    if units:
        _COMPUTE_UNITS[platform.torch_device(local_rank)] = int(units)


def compute_units(device: torch.device) -> int | None:
    """The compute units of `device` as its platform published them, or None."""
    return _COMPUTE_UNITS.get(torch.device(device))
