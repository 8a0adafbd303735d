"""The `Communicator` interface: collectives between the ranks of one model.

Every collective in portaserve (tensor-parallel reductions, weight broadcasts) goes
through a Communicator, so a platform chooses gloo, nccl, rccl, xccl or XLA without the
model or the layers knowing. Public methods validate and short-cut world size 1, then
call the `_`-prefixed methods an implementation overrides.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

REDUCE_OPS = ("sum", "max", "min", "product")


class Communicator(ABC):
    """Collectives over one process group; one instance per rank."""

    name: ClassVar[str]
    platforms: ClassVar[frozenset[str]]

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is out of range for world size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.device = device

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` over all ranks; every rank gets the result (may be in place)."""
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
        if self.world_size == 1:
            return tensor
        return self._all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `tensor` (same shape on all ranks) along `dim`."""
        if self.world_size == 1:
            return tensor
        return self._all_gather(tensor, dim % tensor.dim())

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum `tensor` over ranks and give rank r the r-th of `world_size` equal chunks along `dim`."""
        if self.world_size == 1:
            return tensor
        dim = dim % tensor.dim()
        if tensor.shape[dim] % self.world_size:
            raise ValueError(
                f"reduce_scatter: size {tensor.shape[dim]} of dim {dim} is not divisible "
                f"by world size {self.world_size}"
            )
        return self._reduce_scatter(tensor, dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy `src`'s `tensor` into every rank's `tensor` (in place); returns it."""
        self._check_peer(src, "src")
        if self.world_size == 1:
            return tensor
        return self._broadcast(tensor, src)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send `tensor` to rank `dst` (blocking)."""
        self._check_peer(dst, "dst")
        self._send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into `tensor` from rank `src` (blocking); returns it."""
        self._check_peer(src, "src")
        return self._recv(tensor, src)

    def barrier(self) -> None:
        """Block until every rank reaches the barrier."""
        if self.world_size > 1:
            self._barrier()

    def destroy(self) -> None:
        """Release the process group; the communicator is unusable afterwards."""

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(f"{what} {peer} is out of range for world size {self.world_size}")

    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor: ...

    @abstractmethod
    def _all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor: ...

    @abstractmethod
    def _reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor: ...

    @abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...

    @abstractmethod
    def _send(self, tensor: torch.Tensor, dst: int) -> None: ...

    @abstractmethod
    def _recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...

    @abstractmethod
    def _barrier(self) -> None: ...
