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


class GraphCaptureUnsupported(Exception):
    """Raised by `GraphCapture.capture` when it cannot record the callable (it runs work
    the recorder cannot replay). The engine then runs that batch size eagerly, logging
    the message once; the step itself was already computed eagerly (contract 1.3)."""


class CapturedGraph(Protocol):
    """One recording."""

    def replay(self) -> None:
        """Launch the recorded work again: it reads the current values of the tensors the
        recorded call read and overwrites the tensors it wrote (its output included)."""


class GraphCapture(ABC):
    """Records callables on one device; recordings may share one memory pool."""

    #: The decode batch sizes to record, None for the engine's default buckets (1, 2, 4,
    #: then multiples of 8; smaller batches are padded up to a bucket) (contract 1.3).
    #: A device where padded rows cost time (a CPU), or whose recordings keep their own
    #: intermediates alive, or where larger batches amortize the overhead anyway, lists
    #: exactly the sizes worth it; larger batches then run eagerly.
    batch_sizes: tuple[int, ...] | None = None

    @abstractmethod
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[CapturedGraph, torch.Tensor]:
        """Run `fn` once while recording its device work.

        The caller has already run `fn` eagerly once (kernels compiled, workspaces
        allocated), so recording launches nothing for the first time.

        :returns: (the recording, the tensor `fn` returned: each replay overwrites it).
        :raises GraphCaptureUnsupported: `fn` does work this recorder cannot replay.
        """
