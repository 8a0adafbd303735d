"""The engine-core process that `portaserve serve` starts before it has a plan
(`EngineCoreLauncher`): the front end imports no torch before it, the process serves the
plan it is sent, and exits quietly when the driver stops before sending one."""

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


def test_serve_starts_the_engine_process_before_importing_torch_or_fastapi():
    # A fresh interpreter: pytest has imported torch already.
    code = textwrap.dedent("""
        import os, sys
        from portaserve.framework.engine import core_process

        def launched(self, *args, **kwargs):
            heavy = sorted(m for m in ("torch", "fastapi", "transformers", "numpy") if m in sys.modules)
            print("heavy:", ",".join(heavy) or "none", "start:", core_process.start_method(), flush=True)
            os._exit(0)

        core_process.EngineCoreLauncher.__init__ = launched
        from portaserve.framework.cli import main
        main(["serve", "--port", "1"])
        print("never launched", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "heavy: none" in out.stdout, out.stdout
    if sys.platform.startswith("linux"):
        assert "start: fork" in out.stdout  # nothing but this thread in the front end yet


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
