"""A worker process killed mid-request fails the request within seconds, with an error
that names the rank: under LLM (EngineDeadError from the multiprocess executor) and
through AsyncLLM (the in-flight generate raises), never a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from portaserve import LLM
from portaserve.framework.errors import EngineDeadError

from .util import ENGINE_KW, greedy, prompts_of

# Multi-process runs: the full suite only.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ARCH = "Qwen2ForCausalLM"
PROMPT = prompts_of([12], seed=9)
#: how long the client may wait for the error after the kill
DEADLINE_S = 10.0


def test_killed_worker_fails_llm_generate_promptly(checkpoint):
    llm = LLM(checkpoint(ARCH), tensor_parallel_size=2, **ENGINE_KW)
    try:
        pids = {r["rank"]: r["pid"] for r in llm.llm_engine.core.executor.call_workers("weights_info")}
        result: dict = {}

        def run():
            try:
                llm.generate(PROMPT * 4, greedy(400), use_tqdm=False)
                result["error"] = None
            except BaseException as exc:
                result["error"] = exc
            result["at"] = time.monotonic()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        time.sleep(1.0)  # generating now
        assert thread.is_alive(), result
        killed = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        thread.join(DEADLINE_S)
        assert not thread.is_alive(), "generate hung after a worker died"
        assert isinstance(result["error"], EngineDeadError), result
        assert "rank 1" in str(result["error"])
        assert result["at"] - killed < DEADLINE_S
        with pytest.raises(EngineDeadError, match="rank 1"):
            llm.generate(PROMPT, greedy(2), use_tqdm=False)
    finally:
        llm.shutdown()


def test_killed_worker_fails_async_generate_promptly(checkpoint):
    from portaserve.framework.config import EngineConfig
    from portaserve.framework.engine.core_client import AsyncLLM

    async def run() -> None:
        engine = AsyncLLM(EngineConfig.create(model=checkpoint(ARCH), tensor_parallel_size=2, **ENGINE_KW))
        await engine.start()
        try:
            info = await engine.call("weights_info")
            pid = info["ranks"][1]["pid"]
            got_tokens = asyncio.Event()

            async def consume():
                async for _ in engine.generate("doomed", PROMPT[0], greedy(400)):
                    got_tokens.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(got_tokens.wait(), 60)
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="rank 1"):
                await asyncio.wait_for(task, DEADLINE_S)
            assert time.monotonic() - killed < DEADLINE_S
            assert not engine.is_healthy
        finally:
            await engine.shutdown()

    asyncio.run(run())
