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
