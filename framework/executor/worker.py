"""A worker: one rank's device, communicator and model runner.

The same class runs in-process (one rank), in a spawned worker process, or inside a Ray
actor; it receives the driver's EngineSpec (with its ExecutionPlan) and looks every
component up by name in its own plugin registry — it never re-selects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from portaserve.framework.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from portaserve.framework.engine.startup import EngineSpec
from portaserve.framework.executor.model_runner import ModelRunner
from portaserve.framework.interfaces import Communicator
from portaserve.framework.plugins import get_registry

logger = logging.getLogger("portaserve")


@dataclass(frozen=True, slots=True)
class WorkerRank:
    """Where a worker sits: global rank, world size, rank on its host, rendezvous."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    init_method: str | None = None  # e.g. "tcp://127.0.0.1:29500" when world_size > 1


class Worker:
    def __init__(self, spec: EngineSpec, where: WorkerRank = WorkerRank()) -> None:
        self.spec = spec
        self.where = where
        self.registry = get_registry()
        name = spec.plan.platform.name
        if name not in self.registry.platforms:
            raise RuntimeError(f"worker rank {where.rank}: platform {name!r} is not installed in this process")
        self.platform = self.registry.platforms[name](spec.plan.device)
        self.platform.init_worker(where.local_rank)
        self.communicator: Communicator | None = None
        if where.world_size > 1:
            cls = self.registry.get("communicators", spec.plan.communicator.name)
            self.communicator = cls(
                where.rank, where.world_size, self.platform.torch_device(where.local_rank), init_method=where.init_method
            )
        self.runner = ModelRunner(
            spec,
            self.registry,
            self.platform,
            local_rank=where.local_rank,
            tp_rank=where.rank,
            tp_size=where.world_size,
            communicator=self.communicator,
        )

    def load_model(self) -> None:
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        out = self.runner.execute_model(sched)
        return out if self.where.rank == 0 else None

    def shutdown(self) -> None:
        if self.communicator is not None:
            self.communicator.destroy()
