"""`RayExecutor` (`--distributed-executor-backend ray`): one Ray actor per tensor-parallel rank.

The ranks are placed by a placement group with one bundle per rank — one unit of the
resource the platform names (`Platform.ray_resource`: "GPU", "TPU", ...), else
`{"CPU": 1}` — so they may span every node of a Ray cluster. Each actor runs the same
`Worker` as the other executors; the driver sends each step's SchedulerOutput to every
actor and rank 0's reply carries the output. Ranks rendezvous for their Communicator at
rank 0's node. An actor that dies, or a worker method that raises, fails the engine with
the rank and the error as soon as Ray reports it; nothing waits for the other ranks.

Ray is an optional dependency (`pip install 'portaserve[ray]'`), imported only here. An
initialized Ray (`ray.init(...)` by the caller, or `RAY_ADDRESS`) is used as it is;
otherwise `ray.init()` joins the local cluster or starts one.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from portaserve.framework.engine.startup import EngineSpec
from portaserve.framework.errors import EngineDeadError, UnsupportedError
from portaserve.framework.interfaces import Platform
from portaserve.framework.plugins import get_registry

from .executor import MultiRankExecutor

logger = logging.getLogger("portaserve")

#: How often a waiting driver looks at the actors (seconds).
POLL_INTERVAL_S = 1.0
#: How long the placement group may take to find room for every rank (seconds).
PLACEMENT_TIMEOUT_S = 120.0


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise UnsupportedError(
            f"distributed_executor_backend 'ray' needs Ray, which is not installed ({exc}); "
            "install the extra: pip install 'portaserve[ray]', or use distributed_executor_backend 'mp'"
        ) from None
    return ray


def bundle_for(platform_cls: type[Platform]) -> dict[str, float]:
    """The placement-group bundle of one rank on this platform."""
    return {platform_cls.ray_resource or "CPU": 1.0}


class RayWorkerWrapper:
    """The actor: builds the rank's Worker on request and runs its methods."""

    def __init__(self) -> None:
        self.worker = None

    def node(self) -> tuple[str, str, int]:
        """(Ray node id, node IP, a free TCP port there) — rank 0's are the rendezvous."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.get_runtime_context().get_node_id(), ip, port

    def init_worker(self, spec: EngineSpec, rank: int, world_size: int, local_rank: int, init_method: str) -> None:
        from .worker import Worker, WorkerRank

        self.worker = Worker(spec, WorkerRank(rank, world_size, local_rank, init_method))
        self.worker.load_model()

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def pid(self) -> int:
        import os

        return os.getpid()


class RayExecutor(MultiRankExecutor):
    """Tensor parallelism over Ray actors, one per rank, placed by a placement group."""

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._remove_pg = remove_placement_group
        self.world_size = spec.config.tensor_parallel_size
        self._dead: str | None = None
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(log_to_driver=False)
        bundle = bundle_for(get_registry().platforms[spec.plan.platform.name])
        self.pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        self.actors: list[Any] = []
        try:
            try:
                ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise UnsupportedError(
                    f"tensor_parallel_size {self.world_size}: the Ray cluster has no room for {self.world_size} ranks of "
                    f"{bundle} after {PLACEMENT_TIMEOUT_S:.0f}s (cluster resources: {ray.cluster_resources()})"
                ) from None
            actor_cls = ray.remote(RayWorkerWrapper)
            for rank in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=rank)
                self.actors.append(
                    actor_cls.options(
                        num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                        resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                        scheduling_strategy=strategy, name=None,
                    ).remote()
                )
            nodes = self._gather([a.node.remote() for a in self.actors])
            _, ip, port = nodes[0]
            init_method = f"tcp://{ip}:{port}"
            # Ray shows an actor that reserved a device only that device, so it is local
            # rank 0 there; CPU ranks on one node are numbered (the CPU platform shares the host).
            isolated = "CPU" not in bundle
            seen: dict[str, int] = {}
            local_ranks = []
            for node_id, _, _ in nodes:
                local_ranks.append(0 if isolated else seen.get(node_id, 0))
                seen[node_id] = seen.get(node_id, 0) + 1
            self._gather([
                a.init_worker.remote(spec, rank, self.world_size, local_ranks[rank], init_method)
                for rank, a in enumerate(self.actors)
            ])
            logger.info("Ray executor: %d ranks on %d node(s), rendezvous %s", self.world_size, len(seen) or 1, init_method)
        except BaseException:
            self.shutdown()
            raise

    # ----- calls -----------------------------------------------------------------------

    def _fail(self, rank: int, why: str) -> None:
        self._dead = f"tensor-parallel rank {rank} (Ray actor) failed: {why}"
        logger.error("%s", self._dead)
        raise EngineDeadError(self._dead)

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Each rank's result, failing at the first rank that died or raised."""
        ray = self._ray
        results: list[Any] = [None] * len(refs)
        pending = {ref: rank for rank, ref in enumerate(refs)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_INTERVAL_S)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._fail(rank, f"the actor died: {_first_line(exc)}")
                except ray.exceptions.RayTaskError as exc:
                    cause = getattr(exc, "cause", None) or exc
                    self._fail(rank, f"{type(cause).__name__}: {_first_line(cause)}")
        return results

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        return self._gather([a.call.remote(method, *args) for a in self.actors])

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        self._gather([a.pid.remote() for a in self.actors])

    @property
    def pids(self) -> list[int]:
        return self._gather([a.pid.remote() for a in self.actors])

    def shutdown(self) -> None:
        ray = self._ray
        if not ray.is_initialized():
            return
        if self._dead is None and self.actors:
            try:
                ray.get([a.call.remote("shutdown") for a in self.actors], timeout=10)
            except Exception:
                pass
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        self.actors = []
        if getattr(self, "pg", None) is not None:
            try:
                self._remove_pg(self.pg)
            except Exception:
                pass
            self.pg = None
        if self._owns_ray:
            ray.shutdown()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
