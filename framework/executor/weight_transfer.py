"""Tensors between a trainer and the engine's ranks, for `update_weights_from_distributed`:
both ends of the exchange, kept together so their order of collectives cannot drift.

A trainer joins the engine's ranks in a separate process group, which the platform's
communicator builds (`Communicator.weight_update_group`: the trainer is rank 0, engine
rank r is `rank_offset + r`) outside the engine's own tensor-parallel group. Each update
starts with a verdict all-reduce (`exchange_verdict`), so a rejected update never leaves
the trainer blocked in a broadcast nobody receives; then the trainer broadcasts each
announced tensor in order (`TrainerWeightSender.send`, `receive_weights`). What the
engine does with them (validate, stage, commit) is `weight_update`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from portaserve.framework.distributed import StandaloneGroupCommunicator
from portaserve.framework.interfaces import Communicator
from portaserve.framework.interfaces.communicator import DEFAULT_GROUP_TIMEOUT_S


def exchange_verdict(comm: Communicator, rejected: bool) -> bool:
    """Every member says whether it rejects this update; True when nobody does."""
    flag = torch.tensor([1 if rejected else 0], dtype=torch.int32, device=comm.device)
    comm.all_reduce(flag, op="max")
    return int(flag.item()) == 0


def receive_weights(
    comm: Communicator, specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], device: torch.device, src: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive each announced tensor from `src`, in order, one at a time."""
    for name, dtype, shape in specs:
        buffer = torch.empty(shape, dtype=dtype, device=device)
        comm.broadcast(buffer, src=src)
        yield name, buffer


class TrainerWeightSender:
    """The trainer's side of `update_weights_from_distributed` (rank 0 of the group).

    `backend` must be the one the engine's platform builds its weight-update group with
    (`Communicator.weight_update_group`: gloo unless the communicator says otherwise;
    nccl on CUDA and ROCm), `device` one that backend moves tensors of.

    >>> sender = TrainerWeightSender("127.0.0.1", 29600, world_size=1 + tp_size)
    >>> # concurrently: engine.init_weight_update_group("127.0.0.1", 29600, 1, 1 + tp_size)
    >>> sender.send(model.named_parameters())   # while the engine runs
    >>> # engine.update_weights_from_distributed(names, dtypes, shapes)
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        backend: str = "gloo",
        device: torch.device | str = "cpu",
        timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    ) -> None:
        self.device = torch.device(device)
        self.comm = StandaloneGroupCommunicator(0, world_size, self.device, master_address, master_port, backend, timeout_s)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bool:
        """Broadcast the tensors (in the order the engine was told); False when the engine
        rejected the update, in which case nothing was sent."""
        if not exchange_verdict(self.comm, rejected=False):
            return False
        for _, tensor in named_tensors:
            self.comm.broadcast(tensor.detach().to(self.device).contiguous(), src=0)
        return True

    def close(self) -> None:
        self.comm.destroy()
