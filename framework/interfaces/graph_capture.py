"""`GraphCapture`: recording a step's device work once and replaying it (CUDA graphs, ...).

A platform whose device can record the kernels a callable launches and launch them again
without Python (CUDA and HIP graphs) returns one from `Platform.graph_capture`. The engine
then replays pure-decode steps from one recording per padded batch size; see
`framework/executor/compile.py` (`DecodeGraphForward`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import torch


class CapturedGraph(Protocol):
    """One recording."""

    def replay(self) -> None:
        """Launch the recorded work again: it reads the current values of the tensors the
        recorded call read and overwrites the tensors it wrote (its output included)."""


class GraphCapture(ABC):
    """Records callables on one device; recordings may share one memory pool."""

    @abstractmethod
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[CapturedGraph, torch.Tensor]:
        """Run `fn` once while recording its device work.

        The caller has already run `fn` eagerly once (kernels compiled, workspaces
        allocated), so recording launches nothing for the first time.

        :returns: (the recording, the tensor `fn` returned: each replay overwrites it).
        """
