"""The `Communicator` interface: collectives between the ranks of one model.

Every collective in portaserve (tensor-parallel reductions, weight broadcasts) goes
through a Communicator, so a platform chooses gloo, nccl, rccl, xccl or XLA without the
model or the layers knowing. Public methods validate and short-cut world size 1, then
call the `_`-prefixed methods an implementation overrides.

Besides the tensor-parallel group the engine builds a communicator for, a live weight
update joins a trainer and the engine's ranks in a second group (`weight_update_group`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

REDUCE_OPS = ("sum", "max", "min", "product")
#: Seconds a member of a weight-update group waits for the others (rendezvous, broadcasts).
DEFAULT_GROUP_TIMEOUT_S = 300.0


class Communicator(ABC):
    """Collectives over one process group; one instance per rank."""

    name: ClassVar[str]
    platforms: ClassVar[frozenset[str]]

    def __init__(self, rank: int, world_size: int, device: torch.device, init_method: str | None = None) -> None:
        """Join the group: one instance per rank, built in the rank's own process.

        The engine (and the conformance kit) calls ``cls(rank, world_size, device,
        init_method=init_method)``, `init_method` by keyword. An implementation that
        takes more options gives them defaults (and may accept ``**kwargs`` for options
        a later 1.x engine passes); it calls this constructor with the first three.

        :param rank: this process's rank, in ``[0, world_size)``; rank r computes
            tensor-parallel shard r.
        :param world_size: the number of ranks (the tensor-parallel size). With 1 there
            is no group to join, and every collective returns its input.
        :param device: the torch device this rank computes on
            (`Platform.torch_device(local_rank)`); tensors passed in live there.
        :param init_method: where the ranks meet, a torch.distributed-style URL
            ("tcp://HOST:PORT", the same for every rank); None when `world_size` is 1.
            A communicator whose runtime forms the group itself (XLA's PJRT) ignores it.
        :raises ValueError: `rank` out of range (and, in an implementation, no
            `init_method` where one is needed).
        """
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

    @classmethod
    def weight_update_group(
        cls,
        rank: int,
        world_size: int,
        device: torch.device,
        master_address: str,
        master_port: int,
        timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    ) -> Communicator:
        """A communicator over a new group that a trainer and the engine's ranks join, for
        live weight updates (`LLM.init_weight_update_group`): the trainer is rank 0 and
        hosts the rendezvous at `master_address:master_port`, engine rank r is rank
        `rank_offset + r` (the offset the caller chose). The group lives beside the tensor-parallel one (a process may
        belong to both) until its `destroy()`; it carries `all_reduce` and `broadcast`.

        Every member must use the same torch.distributed backend: the trainer's side
        (`TrainerWeightSender`) names it. The default is a gloo group on `device`
        (host tensors, and CUDA ones); a communicator whose devices need another backend
        overrides this (`TorchDistributedCommunicator` uses its own).

        :raises Exception: the rendezvous failed or timed out (reported to the caller;
            the engine keeps serving).
        """
        from portaserve.framework.distributed import StandaloneGroupCommunicator

        return StandaloneGroupCommunicator(rank, world_size, device, master_address, master_port, "gloo", timeout_s)

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
