"""A Communicator over a torch.distributed process group, for any backend name.

Platforms subclass it with their backend (gloo, nccl, xccl, ...); nothing here is
vendor-specific: torch.distributed dispatches to the backend the subclass names.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from .interfaces import Communicator

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

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        init_method: str | None = None,
        group: "dist.ProcessGroup | None" = None,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(rank, world_size, device)
        self._owns_group = False
        self.group = group
        if world_size > 1 and group is None:
            if init_method is None:
                raise ValueError("init_method (e.g. 'tcp://127.0.0.1:29500') is required for world_size > 1")
            import datetime

            if not dist.is_initialized():
                dist.init_process_group(
                    self.dist_backend,
                    init_method=init_method,
                    rank=rank,
                    world_size=world_size,
                    timeout=datetime.timedelta(seconds=timeout_s),
                )
                self._owns_group = True
            self.group = dist.new_group(list(range(world_size)), backend=self.dist_backend) if not self._owns_group else None

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
