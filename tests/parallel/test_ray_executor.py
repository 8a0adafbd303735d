"""The Ray executor: a local Ray head on 127.0.0.1, TP=2 as two Ray actors placed by a
placement group, the same greedy tokens as TP=1; a dead actor fails the engine with its
rank. Skipped only when the `ray` extra is not installed (CI installs it)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed: pip install 'portaserve[ray]'")

from portaserve import LLM  # noqa: E402
from portaserve.framework.errors import EngineDeadError  # noqa: E402

from .util import ENGINE_KW, generate_ids, greedy, prompts_of  # noqa: E402

# Multi-process runs: the full suite only.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ARCH = "Qwen2ForCausalLM"
PROMPTS = prompts_of([4, 30, 70], seed=13)


@pytest.fixture(scope="module")
def ray_head():
    # A fresh local head bound to the loopback address, sized for a 2-core machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def test_tp2_through_ray_matches_tp1(ray_head, checkpoint, reference_ids):
    llm = LLM(checkpoint(ARCH), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KW)
    try:
        executor = llm.llm_engine.core.executor
        assert type(executor).__name__ == "RayExecutor"
        pids = executor.pids
        assert len(set(pids)) == 2 and os.getpid() not in pids
        assert generate_ids(llm, PROMPTS, 8) == reference_ids(PROMPTS, 8, ARCH)
        # live updates go through the same worker code
        llm.update_weights(checkpoint(ARCH, 1))
        assert generate_ids(llm, PROMPTS, 8) == reference_ids(PROMPTS, 8, ARCH, 1)
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 20  # actors and placement group are released (asynchronously)
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2


def test_dead_ray_actor_fails_the_engine_with_its_rank(ray_head, checkpoint):
    llm = LLM(checkpoint(ARCH), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KW)
    try:
        pids = llm.llm_engine.core.executor.pids
        result: dict = {}

        def run():
            try:
                llm.generate(PROMPTS, greedy(400), use_tqdm=False)
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        time.sleep(1.0)
        os.kill(pids[1], signal.SIGKILL)
        thread.join(15)
        assert not thread.is_alive(), "generate hung after a Ray actor died"
        assert isinstance(result.get("error"), EngineDeadError), result
        assert "rank 1" in str(result["error"])
    finally:
        llm.shutdown()


def test_tp2_across_two_ray_nodes_matches_tp1(checkpoint, reference_ids, monkeypatch):
    """Two Ray nodes on this machine (ray.cluster_utils.Cluster: a head and a worker node,
    one CPU each), so the placement group must put one rank on each."""
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    expected = reference_ids(PROMPTS, 8, ARCH)
    if ray.is_initialized():
        ray.shutdown()
    # every node on the loopback address (Ray would otherwise resolve this host's external
    # address, which the sandboxed test machine cannot connect to)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        llm = LLM(checkpoint(ARCH), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_KW)
        try:
            executor = llm.llm_engine.core.executor
            node_ids = ray.get([actor.node.remote() for actor in executor.actors])
            assert len({n[0] for n in node_ids}) == 2, node_ids  # one rank per Ray node
            assert generate_ids(llm, PROMPTS, 8) == expected
        finally:
            llm.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
