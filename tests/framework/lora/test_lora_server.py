"""LoRA adapters through the server: chosen by model name, listed in /v1/models, loaded,
unloaded and reloaded at run time while requests on other adapters are in flight, and
counted in /metrics. Outputs equal transformers + peft's (float32 greedy)."""

from __future__ import annotations


import threading

import httpx
import pytest
import torch

# peft (the test extra) is imported inside the tests: at collection it would import triton
# (through transformers), before the Triton kernel tests set TRITON_INTERPRET

from lora_adapters import reference_greedy, write_adapter  # noqa: E402
from portaserve.framework.config import EngineConfig  # noqa: E402
from portaserve.framework.server.state import ServerSettings  # noqa: E402
from server_harness import ServerThread, metric  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "lora-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from portaserve.models.checkpoints import write_checkpoint

    root = tmp_path_factory.mktemp("lora-srv")
    base = str(write_checkpoint("Qwen2ForCausalLM", "tiny", root / "base"))
    allowed = root / "adapters"
    adapters = {f"a{i}": write_adapter(base, allowed / f"a{i}", seed=10 + i, rank=8) for i in range(1, 4)}
    dora = write_adapter(base, allowed / "dora", seed=20, rank=4, use_dora=True)
    outside = write_adapter(base, root / "elsewhere", seed=21, rank=4)
    config = EngineConfig.create(model=base, dtype="float32", max_model_len=512, served_model_name="base",
                                 enable_lora=True, max_loras=2, max_lora_rank=8)
    settings = ServerSettings(api_keys=(KEY,), lora_modules=(("a1", adapters["a1"]),),
                              allowed_lora_paths=(str(allowed),))
    with ServerThread(config, settings) as server:
        yield server, base, adapters, dora, outside


def generate(url: str, model: str, prompt: list[int], max_tokens: int = 8) -> httpx.Response:
    return httpx.post(url + "/inference/v1/generate", headers=HEADERS, timeout=120, json={
        "model": model, "token_ids": prompt,
        "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})


def tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


PROMPT = torch.randint(0, 1000, (11,), generator=torch.Generator().manual_seed(5)).tolist()


def test_adapters_by_model_name_and_in_the_model_list(setup):
    srv, base, adapters, _, _ = setup
    cards = {c["id"]: c for c in httpx.get(srv.url + "/v1/models", headers=HEADERS).json()["data"]}
    assert cards["a1"]["parent"] == "base" and cards["a1"]["root"].endswith("a1")
    assert tokens(generate(srv.url, "a1", PROMPT)) == reference_greedy(base, adapters["a1"], PROMPT, 8)
    assert tokens(generate(srv.url, "base", PROMPT)) == reference_greedy(base, None, PROMPT, 8)
    chat = httpx.post(srv.url + "/v1/completions", headers=HEADERS, timeout=60,
                      json={"model": "a1", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["model"] == "a1"


def test_load_unload_and_reload_with_requests_in_flight(setup):
    srv, base, adapters, dora, outside = setup
    long_done: dict = {}

    def long_request():  # a request on a1 that runs through the loads and unloads below
        long_done["tokens"] = tokens(generate(srv.url, "a1", PROMPT, max_tokens=200))

    thread = threading.Thread(target=long_request)
    thread.start()
    load = httpx.post(srv.url + "/v1/load_lora_adapter", headers=HEADERS,
                      json={"lora_name": "a2", "lora_path": adapters["a2"]})
    assert load.status_code == 200, load.text
    assert tokens(generate(srv.url, "a2", PROMPT)) == reference_greedy(base, adapters["a2"], PROMPT, 8)
    assert httpx.post(srv.url + "/v1/unload_lora_adapter", headers=HEADERS, json={"lora_name": "a2"}).status_code == 200
    gone = generate(srv.url, "a2", PROMPT)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    # the name again, for other files: the new adapter runs, not the old one's cached weights
    assert httpx.post(srv.url + "/v1/load_lora_adapter", headers=HEADERS,
                      json={"lora_name": "a2", "lora_path": adapters["a3"]}).status_code == 200
    assert tokens(generate(srv.url, "a2", PROMPT)) == reference_greedy(base, adapters["a3"], PROMPT, 8)
    thread.join(120)
    assert long_done["tokens"] == reference_greedy(base, adapters["a1"], PROMPT, 200)
    # refused: outside the allowed folder, a DoRA adapter, a taken name, an unknown one
    for body, status, words in (
        ({"lora_name": "x", "lora_path": outside}, 400, "not under an allowed folder"),
        ({"lora_name": "x", "lora_path": dora}, 400, "DoRA"),
        ({"lora_name": "base", "lora_path": adapters["a1"]}, 400, "already served"),
    ):
        r = httpx.post(srv.url + "/v1/load_lora_adapter", headers=HEADERS, json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    r = httpx.post(srv.url + "/v1/unload_lora_adapter", headers=HEADERS, json={"lora_name": "nope"})
    assert r.status_code == 404
    assert httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": adapters["a1"]}
                      ).status_code == 401  # behind the API key


def test_metrics_count_adapters(setup):
    srv, *_ = setup
    generate(srv.url, "a1", PROMPT, max_tokens=2)
    text = httpx.get(srv.url + "/metrics", headers=HEADERS).text
    assert metric(text, "portaserve:lora_requests_total", lora_name="a1") >= 1
    assert metric(text, "portaserve:lora_loads", model_name="base") >= 2
    assert metric(text, "portaserve:loras_resident", model_name="base") >= 1
