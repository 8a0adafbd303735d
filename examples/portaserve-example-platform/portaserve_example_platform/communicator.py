"""Collectives for the example device: torch.distributed's gloo backend, on host tensors.

Written against the `Communicator` interface only. The engine builds one per rank as
``ExampleGlooCommunicator(rank, world_size, device, init_method=URL)`` (the kit does the
same); with world size 1 there is no process group at all.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from portaserve.framework.interfaces import Communicator

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


class ExampleGlooCommunicator(Communicator):
    name = "example_gloo"
    platforms = frozenset({"example"})
    #: The torch.distributed backend of this communicator's groups.
    dist_backend = "gloo"

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        init_method: str | None = None,
        timeout_s: float = 600.0,
        **_future: object,  # arguments a later 1.x engine may pass
    ) -> None:
        super().__init__(rank, world_size, device)
        self._group = None  # None: the default group
        self._owns_default_group = False
        if world_size == 1:
            return
        if init_method is None:
            raise ValueError("init_method (e.g. 'tcp://127.0.0.1:29500') is required for world_size > 1")
        if dist.is_initialized():
            # someone else made the default group: ours is a subgroup of it
            self._group = dist.new_group(list(range(world_size)), backend=self.dist_backend)
        else:
            dist.init_process_group(
                self.dist_backend,
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
            self._owns_default_group = True

    def destroy(self) -> None:
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        elif self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._owns_default_group = False
        self._group = None

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        dist.all_reduce(tensor, op=_OPS[op], group=self._group)
        return tensor

    def _all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self._group)
        return torch.cat(parts, dim=dim)

    def _reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        # gloo has no reduce_scatter: reduce everything, keep this rank's chunk
        full = tensor.clone()
        dist.all_reduce(full, group=self._group)
        return full.chunk(self.world_size, dim=dim)[self.rank].contiguous()

    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.broadcast(tensor, src=src, group=self._group)
        return tensor

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor.contiguous(), dst=dst, group=self._group)

    def _recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(tensor, src=src, group=self._group)
        return tensor

    def _barrier(self) -> None:
        dist.barrier(group=self._group)
