"""Executors: how the engine core reaches its workers.

`UniProcExecutor` runs one rank in the engine's own process. Multi-rank executors
(worker processes, Ray actors) derive from `MultiRankExecutor` and say only how one
method reaches every rank (`_call_all`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from portaserve.framework.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from portaserve.framework.engine.startup import EngineSpec


class Executor(ABC):
    """Drives every worker of one engine in lockstep."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every rank can hold (the minimum over ranks)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks on every rank."""

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; returns rank 0's output."""

    def call_workers(self, method: str, *args):
        """Run a Worker method on every rank; returns the per-rank results."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop workers and release their resources."""

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker has died."""


class UniProcExecutor(Executor):
    """One rank, in this process."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        from .worker import Worker

        self.worker = Worker(spec)
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        out = self.worker.execute_model(sched)
        assert out is not None  # rank 0 always returns its output
        return out

    def call_workers(self, method: str, *args):
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        self.worker.shutdown()


class MultiRankExecutor(Executor):
    """Every rank in its own process (or actor), driven by one remote call per method."""

    @abstractmethod
    def _call_all(self, method: str, *args: Any) -> list[Any]:
        """Run Worker `method` on every rank; the per-rank results, rank 0 first
        (EngineDeadError when a rank is gone)."""

    def determine_num_blocks(self) -> int:
        return min(self._call_all("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("initialize_kv_cache", num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self._call_all("execute_model", sched)[0]

    def call_workers(self, method: str, *args: Any) -> list[Any]:
        """Run a Worker method on every rank (weight updates, sleep / wake)."""
        return self._call_all(method, *args)


def make_executor(spec: EngineSpec) -> Executor:
    """The executor for `spec`'s tensor-parallel size and backend choice."""
    backend = spec.config.distributed_executor_backend
    tp = spec.config.tensor_parallel_size
    if spec.config.node_rank > 0 or spec.config.headless:
        from portaserve.framework.errors import invalid

        raise invalid("node_rank", f"node {spec.config.node_rank} runs headless workers only (portaserve serve "
                      "--headless ...); the engine runs on node 0")
    if backend == "uni" or (backend == "auto" and tp == 1):
        if tp != 1:
            from portaserve.framework.errors import invalid

            raise invalid("distributed_executor_backend", f"'uni' runs one rank; tensor_parallel_size={tp} needs 'mp' or 'ray'")
        return UniProcExecutor(spec)
    if backend in ("auto", "mp"):
        from .multiproc import MultiprocExecutor

        return MultiprocExecutor(spec)
    if backend == "ray":
        from .ray_executor import RayExecutor

        return RayExecutor(spec)
    raise NotImplementedError(f"distributed executor backend {backend!r}")
