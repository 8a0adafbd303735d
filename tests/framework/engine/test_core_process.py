"""The engine-core process that `portaserve serve` starts before it has a plan
(`EngineCoreLauncher`): the front end has imported torch and nothing heavier when it forks
it, the process serves the plan it is sent, and exits quietly when the driver stops
before sending one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from portaserve.framework.config import EngineConfig
from portaserve.framework.engine.core_process import EngineCoreLauncher, start_method
from portaserve.framework.engine.params import SamplingParams


def test_serve_forks_the_engine_process_before_the_plugins_the_plan_and_the_server():
    # A fresh interpreter: pytest has imported everything already.
    code = textwrap.dedent("""
        import os, sys
        from portaserve.framework.engine import core_process

        def launched(self, *args, **kwargs):
            loaded = [m for m in ("torch", "portaserve.framework.plugins", "portaserve.platforms.cpu", "fastapi",
                                  "uvicorn", "transformers", "portaserve.framework.server.app") if m in sys.modules]
            print("loaded:", ",".join(loaded), "start:", core_process.start_method(),
                  "OPENBLAS_NUM_THREADS" in os.environ, flush=True)
            os._exit(0)

        core_process.EngineCoreLauncher.__init__ = launched
        from portaserve.framework.cli import main
        main(["serve", "--port", "1"])
        print("never launched", flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    # torch only (both processes need it); the environment is left as it was
    assert "loaded: torch start:" in out.stdout and out.stdout.strip().endswith("False"), out.stdout
    if sys.platform.startswith("linux"):
        assert "start: fork" in out.stdout  # torch's import left this process single-threaded


def test_start_method_spawns_once_another_thread_runs():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert start_method() == "spawn"
    finally:
        stop.set()
        thread.join()


def test_a_launcher_cancelled_before_the_plan_exits_quietly():
    launcher = EngineCoreLauncher()
    launcher.cancel()
    launcher.proc.join(60)
    assert launcher.proc.exitcode == 0
    assert launcher.sent


@pytest.mark.slow  # an engine in its own process (`portaserve serve`'s tests start one the same way)
@pytest.mark.timeout(240)
def test_the_launched_engine_serves_the_plan_it_is_sent(checkpoint):
    from portaserve.framework.engine.core_client import AsyncLLM
    from portaserve.framework.engine.startup import resolve_engine

    config = EngineConfig.create(model=str(checkpoint("Qwen2ForCausalLM")), device="cpu", max_model_len=128,
                                 max_num_seqs=4)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the engine process of a small, shared test machine
    try:
        launcher = EngineCoreLauncher()  # before the plan, as `serve` does
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    spec = resolve_engine(config)
    launcher.send(spec)

    async def generate() -> list[int]:
        engine = AsyncLLM(config, spec, launcher=launcher)
        try:
            await engine.start()
            assert engine.is_healthy and engine.num_blocks > 0
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            final = None
            async for out in engine.generate("r0", [1, 2, 3, 4, 5], params):
                final = out
            return list(final.outputs[0].token_ids)
        finally:
            await engine.shutdown()

    start = time.monotonic()
    tokens = asyncio.run(generate())
    assert len(tokens) == 4
    assert launcher.proc.exitcode == 0 and time.monotonic() - start < 200
