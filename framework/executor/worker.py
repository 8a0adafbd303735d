"""A worker: one rank's device, communicator and model runner.

The same class runs in-process (one rank), in a spawned worker process, or inside a Ray
actor; it receives the driver's EngineSpec (with its ExecutionPlan) and looks every
component up by name in its own plugin registry — it never re-selects.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from portaserve.framework import device_properties
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
        device_properties.publish(self.platform, where.local_rank)  # for kernels that size grids by it
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

    # ----- live weight updates (see weight_update.py), sleep / wake ----------------------

    def lora_stats(self) -> dict[str, int]:
        return self.runner.lora_stats()

    def weights_info(self) -> dict:
        """This rank's parameters: how many tensors and bytes it holds, and where."""
        from .weight_update import _unique_params

        params = _unique_params(self.runner.model)
        return {
            "rank": self.where.rank,
            "pid": os.getpid(),
            "num_tensors": len(params),
            "num_bytes": sum(p.numel() * p.element_size() for p in params),
            "kv_cache_bytes": self._kv_cache_bytes(),
            "sleep_level": self._sleep_level,
        }

    @property
    def _sleep_level(self) -> int:
        """2: weights offloaded (and KV released), 1: KV cache released, 0: awake."""
        if getattr(self, "_offloaded", None) is not None:
            return 2
        return 1 if getattr(self, "_kv_released", False) else 0

    def _stager(self):
        from .weight_update import WeightStager

        if getattr(self, "_weight_stager", None) is None:
            self._weight_stager = WeightStager(self.runner.model)
        return self._weight_stager

    def stage_weights_from_folder(self, path: str):
        """Load a checkpoint folder into staged copies of this rank's shards (StageResult)."""
        from portaserve.framework.checkpoint import iter_safetensors

        from .weight_update import stage_safely

        return stage_safely(self._stager(), iter_safetensors(path, progress=False), partial=False)

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 timeout_s: float):
        """Join the trainer's weight-update group as rank `rank_offset + rank` (StageResult)."""
        from .weight_update import StageResult

        self.destroy_weight_update_group()
        try:
            cls = self.registry.get("communicators", self.spec.plan.communicator.name)
            self._update_comm = cls.weight_update_group(
                rank_offset + self.where.rank, world_size, self.runner.device, master_address, master_port, timeout_s
            )
        except Exception as exc:  # a failed rendezvous must not take the engine down
            return StageResult(False, error_param="master_address", error=f"cannot join the weight-update group at "
                               f"{master_address}:{master_port}: {type(exc).__name__}: {exc}")
        return StageResult(True)

    def destroy_weight_update_group(self) -> None:
        comm = getattr(self, "_update_comm", None)
        if comm is not None:
            comm.destroy()
        self._update_comm = None

    def stage_weights_from_distributed(self, specs, rejection: str | None):
        """Take part in one trainer broadcast: the verdict, then (if nobody rejected) every
        announced tensor into staged copies (StageResult). A rank that fails while staging
        still receives the remaining tensors, so the trainer never blocks."""
        from .weight_transfer import exchange_verdict, receive_weights
        from .weight_update import StageResult, stage_safely

        comm = getattr(self, "_update_comm", None)
        if comm is None:
            return StageResult(False, error_param="init_weight_update_group", error="no weight-update group: call "
                               "init_weight_update_group first")
        if not exchange_verdict(comm, rejected=rejection is not None):
            return StageResult(False, error_param="weights", error=rejection or "the update was rejected by another "
                               "member of the weight-update group")
        incoming = receive_weights(comm, specs, self.runner.device)
        try:
            return stage_safely(self._stager(), incoming, partial=True)
        finally:
            for _ in incoming:  # keep in step with the trainer after a failure
                pass

    def commit_staged_weights(self) -> int:
        return self._stager().commit()

    def discard_staged_weights(self) -> None:
        self._stager().discard()

    def sleep(self, level: int) -> dict:
        """Release the KV cache; level 2 also moves the weights to host memory and frees
        their device storage (see weight_offload.py). Returns the bytes released."""
        from .weight_offload import OffloadedWeights

        runner = self.runner
        kv_bytes = self._kv_cache_bytes()
        if runner.kv_caches:
            runner.release_kv_cache()
            self._kv_released = True
        weight_bytes = 0
        if level >= 2 and getattr(self, "_offloaded", None) is None:
            models = [runner.model] + ([runner.drafter.model] if runner.drafter is not None else [])
            # one container: a tensor the two models share is released once
            from torch import nn

            self._offloaded = OffloadedWeights(models[0] if len(models) == 1 else nn.ModuleList(models))
            weight_bytes = self._offloaded.num_bytes
        self.platform.synchronize(self.where.local_rank)
        return {"kv_cache_bytes": kv_bytes, "weights_bytes": weight_bytes}

    def _kv_cache_bytes(self) -> int:
        """The KV caches' bytes on this rank (the draft model's too)."""
        runner = self.runner
        caches = [*runner.kv_caches, *(runner.drafter.kv_caches if runner.drafter is not None else ())]
        return sum(t.numel() * t.element_size() for t in caches)

    def wake_up(self, tags: list[str]) -> dict:
        """Restore what `sleep` released: "weights" back on the device, "kv_cache" reallocated."""
        runner = self.runner
        weight_bytes = kv_bytes = 0
        if "weights" in tags and getattr(self, "_offloaded", None) is not None:
            weight_bytes = self._offloaded.restore()
            self._offloaded = None
        if "kv_cache" in tags and getattr(self, "_kv_released", False):
            runner.initialize_kv_cache(runner.num_blocks)
            kv_bytes = self._kv_cache_bytes()
            self._kv_released = False
        return {"kv_cache_bytes": kv_bytes, "weights_bytes": weight_bytes}

    def shutdown(self) -> None:
        self.destroy_weight_update_group()
        if self.communicator is not None:
            self.communicator.destroy()
