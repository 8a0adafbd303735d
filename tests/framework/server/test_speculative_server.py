"""Speculative decoding through the server (n-gram, and a draft model): several tokens per
step stream as deltas that concatenate to the non-streamed text, and /metrics counts
proposals and accepted tokens."""

from __future__ import annotations

import httpx
import openai
import pytest

from portaserve.framework.config import EngineConfig
from portaserve.framework.server.state import ServerSettings
from server_harness import ServerThread, metric

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def srv(request, tmp_path_factory):
    import json

    from portaserve.models.checkpoints import write_checkpoint
    from portaserve.models.truncated import truncate_checkpoint

    ckpt = write_checkpoint("Qwen2ForCausalLM", "tiny", tmp_path_factory.mktemp("qwen2-spec"))
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    if request.param == "draft_model":  # the target's first 2 of 3 layers
        spec = {"model": str(truncate_checkpoint(ckpt, tmp_path_factory.mktemp("draft") / "d2", 2)),
                "num_speculative_tokens": 4}
    config = EngineConfig.create(model=str(ckpt), dtype="float32", max_model_len=512, served_model_name="tiny",
                                 speculative_config=json.dumps(spec))
    with ServerThread(config, ServerSettings()) as server:
        yield server


def test_streamed_equals_not_streamed_and_metrics(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = [11, 22, 33, 44, 11, 22, 33, 44, 11, 22, 33]
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    chunks = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(chunks) == full and full
    assert len(chunks) < 40  # several tokens arrived in one step
    text = httpx.get(srv.url + "/metrics").text
    proposed = metric(text, "portaserve:spec_decode_num_draft_tokens_total", model_name="tiny")
    accepted = metric(text, "portaserve:spec_decode_num_accepted_tokens_total", model_name="tiny")
    assert proposed > 0 and 0 < accepted <= proposed
