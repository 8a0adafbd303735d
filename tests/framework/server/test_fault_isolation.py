"""A request that fails inside the engine fails alone: a 500 in OpenAI's error shape for
it, while the engine and every other running request go on (a raising logits processor,
NaN logits, a detokenizer error in the front end)."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from faulty_processor import FAIL_AT
from portaserve.framework.config import EngineConfig
from server_harness import ServerThread

# two servers, requests that run to their fault: the full suite (the engine-level case is
# in tests/framework/engine/test_llm_engine.py, in the fast tier)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["faulty_processor:FailAtStep", "faulty_processor:NaNAtStep"],
                ids=["raising-processor", "nan-logits"])
def srv(request, tmp_path_factory):
    from portaserve.models.checkpoints import write_checkpoint

    ckpt = write_checkpoint("Qwen2ForCausalLM", "tiny", tmp_path_factory.mktemp("qwen2"))
    config = EngineConfig.create(model=str(ckpt), max_model_len=256, served_model_name="tiny",
                                 logits_processors=[request.param])
    with ServerThread(config) as server:
        yield server


def complete(url: str, max_tokens: int, stream: bool = False) -> httpx.Response:
    body = {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_the_failing_request_gets_a_500_and_the_others_finish(srv):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        healthy = [pool.submit(complete, srv.url, FAIL_AT) for _ in range(6)]  # stop just before the fault
        failing = [pool.submit(complete, srv.url, FAIL_AT + 10) for _ in range(2)]
        for f in healthy:
            r = f.result()
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == FAIL_AT
        for f in failing:
            r = f.result()
            assert r.status_code == 500
            error = r.json()["error"]
            assert error["code"] == 500 and error["type"] == "InternalServerError"
            assert "failed in the engine" in error["message"]
    # the engine goes on: nothing left running, later requests are served
    stats = srv.engine.latest_stats
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0
    assert srv.engine.num_in_flight() == 0
    assert complete(srv.url, 2).status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200


def test_a_failing_stream_ends_with_an_error_event(srv):
    r = complete(srv.url, FAIL_AT + 10, stream=True)
    assert r.status_code == 200
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert '"error"' in events[-2] and "failed in the engine" in events[-2] and events[-1] == "data: [DONE]"
    assert complete(srv.url, 2).status_code == 200
