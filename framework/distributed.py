"""A Communicator over a torch.distributed process group, for any backend name.

Platforms subclass it with their backend (gloo, nccl, xccl, ...); nothing here is
vendor-specific: torch.distributed dispatches to the backend the subclass names. The
same goes for the standalone groups a live weight update builds beside the default one
(`StandaloneGroupCommunicator`).
"""

from __future__ import annotations

import datetime
from typing import ClassVar

import torch
import torch.distributed as dist

from .interfaces import Communicator
from .interfaces.communicator import DEFAULT_GROUP_TIMEOUT_S

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


class TorchDistributedCommunicator(Communicator):
    """Collectives through `torch.distributed` with the backend in `dist_backend`.

    The process group is created on construction (TCP rendezvous at `init_method`)
    unless one is passed in; `destroy()` tears down a group this instance created.
    """

    dist_backend: ClassVar[str]

    @classmethod
    def group_backend(cls) -> str:
        """The backend name the groups are built with: `dist_backend`, unless a subclass
        decides at run time (XPU: whichever collective library is installed)."""
        return cls.dist_backend

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
        """The weight-update group over this communicator's own backend (see `Communicator`)."""
        return StandaloneGroupCommunicator(rank, world_size, device, master_address, master_port, cls.group_backend(), timeout_s)

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        init_method: str | None = None,
        group: "dist.ProcessGroup | None" = None,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(rank, world_size, device, init_method)
        self._owns_group = False
        self.group = group
        if world_size > 1 and group is None:
            if init_method is None:
                raise ValueError("init_method (e.g. 'tcp://127.0.0.1:29500') is required for world_size > 1")
            backend = self.group_backend()
            if not dist.is_initialized():
                dist.init_process_group(
                    backend,
                    init_method=init_method,
                    rank=rank,
                    world_size=world_size,
                    timeout=datetime.timedelta(seconds=timeout_s),
                )
                self._owns_group = True
            self.group = dist.new_group(list(range(world_size)), backend=backend) if not self._owns_group else None

    def destroy(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        dist.all_reduce(tensor, op=_OPS[op], group=self.group)
        return tensor

    def _all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)

    def _reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        # gloo has no reduce_scatter; all_reduce + slice is correct on every backend,
        # and backends with a native one override this.
        full = tensor.clone()
        dist.all_reduce(full, group=self.group)
        return full.chunk(self.world_size, dim=dim)[self.rank].contiguous()

    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.broadcast(tensor, src=src, group=self.group)
        return tensor

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor.contiguous(), dst=dst, group=self.group)

    def _recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(tensor, src=src, group=self.group)
        return tensor

    def _barrier(self) -> None:
        dist.barrier(group=self.group)


def standalone_group(
    backend: str, store: dist.Store, rank: int, world_size: int, name: str, timeout: datetime.timedelta
) -> dist.ProcessGroup:
    """A process group over `store` outside torch.distributed's default group, with the
    backend torch knows by `backend` (built in, or registered by a plugin such as oneCCL).

    torch has no public constructor for such a group: `init_process_group` makes only the
    default one and `new_group` only subgroups of it. Its own helper behind both builds a
    group for any backend name, as verl and OpenRLHF do for their trainer-to-engine
    groups; the identity rank map lets `dist.*` collectives address the group's ranks and
    `dist.destroy_process_group` release it. Every member passes the same `name`.
    """
    from torch.distributed import distributed_c10d as c10d

    group, _ = c10d._new_process_group_helper(world_size, rank, [], backend, store, group_name=name, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {r: r for r in range(world_size)}
    return group


class StandaloneGroupCommunicator(TorchDistributedCommunicator):
    """Collectives over a group of its own (a trainer and the engine's ranks), beside the
    default group the engine's tensor-parallel ranks may form: rank 0 hosts its TCP store
    at `master_address:master_port`, every member names the same `backend`."""

    name = "standalone_group"
    platforms = frozenset()

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        master_address: str,
        master_port: int,
        backend: str,
        timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    ) -> None:
        # checked before the rendezvous, which would otherwise wait for a rank that never comes
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is out of range for world size {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0), timeout=timeout)
        name = f"portaserve-standalone:{master_address}:{master_port}"
        group = standalone_group(backend, self.store, rank, world_size, name, timeout)
        super().__init__(rank, world_size, device, group=group)

    def destroy(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
        self.group = None
        self.store = None
