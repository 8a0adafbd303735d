"""Collectives between TPU ranks through torch_xla's XLA collective ops.

The ranks are PJRT's replicas (one process per chip, as started by the executor; the
global ordinal is the rank). XLA collectives are traced into the step's graph and run
when it executes, so a collective must be reached by every rank in the same program
order, the same rule as any SPMD collective. Send/recv map to XLA Send/Recv, paired by a
channel id derived from (src, dst).
"""

from __future__ import annotations

import torch

from portaserve.framework.interfaces import Communicator


def _xm():
    import torch_xla.core.xla_model as xm

    return xm


class XlaCommunicator(Communicator):
    name = "xla"
    platforms = frozenset({"tpu"})

    def __init__(self, rank, world_size, device, init_method=None, group=None, timeout_s: float = 600.0) -> None:
        # The same signature as TorchDistributedCommunicator's; PJRT does the rendezvous
        # (the executor starts one process per chip), so init_method and group are unused.
        super().__init__(rank, world_size, device)

    def _reduce_type(self, op: str) -> str:
        xm = _xm()
        return {"sum": xm.REDUCE_SUM, "max": xm.REDUCE_MAX, "min": xm.REDUCE_MIN, "product": xm.REDUCE_MUL}[op]

    def _channel(self, src: int, dst: int) -> int:
        # Channel ids must be positive and identify the (src, dst) pair on both sides.
        return 1 + src * self.world_size + dst

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        # xm.all_reduce on a single tensor returns a new one; the interface allows in place.
        reduced = _xm().all_reduce(self._reduce_type(op), tensor)
        tensor.copy_(reduced)
        return tensor

    def _all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return _xm().all_gather(tensor.contiguous(), dim=dim)

    def _reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        xm = _xm()
        return xm.reduce_scatter(xm.REDUCE_SUM, tensor, 1.0, dim, self.world_size)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        _xm().collective_broadcast([tensor], root_ordinal=src)
        return tensor

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        _xm().send(tensor, self._channel(self.rank, dst))

    def _recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        received = _xm().recv(tensor, self._channel(src, self.rank))
        if received is not tensor:
            tensor.copy_(received)
        return tensor

    def _barrier(self) -> None:
        _xm().rendezvous("portaserve.barrier")
