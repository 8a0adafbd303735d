"""The weight-update and sleep routes of the HTTP server, end to end (uvicorn on
127.0.0.1, the engine core in its own process): API-key protected, OpenAI error shape for
bad input, the weights version in /v1/models, the generated tokens of the new weights."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from portaserve.framework.config import EngineConfig
from portaserve.framework.server.state import ServerSettings

from .util import ENGINE_KW, prompts_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "framework" / "server"))
from server_harness import ServerThread  # noqa: E402  (the server tests' harness)

ARCH = "Qwen2ForCausalLM"
KEY = "weights-key"
PROMPT = prompts_of([24], seed=11)[0]


@pytest.fixture(scope="module")
def srv(checkpoint):
    config = EngineConfig.create(model=checkpoint(ARCH, 0), **ENGINE_KW)
    settings = ServerSettings(api_keys=(KEY,), enable_admin_api=True, weight_update_allowed_addresses=("127.0.0.0/8",))
    with ServerThread(config, settings) as server:
        yield server


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def _generate(http, version: int | None = None) -> list[int]:
    body = {"token_ids": PROMPT["prompt_token_ids"], "sampling_params": {"temperature": 0, "max_tokens": 8, "ignore_eos": True}}
    r = http.post("/inference/v1/generate", json=body)
    assert r.status_code == 200, r.text
    if version is not None:  # the weights the tokens came from, in the response's headers
        assert r.headers["x-weights-version"] == str(version)
        with http.stream("POST", "/inference/v1/generate", json={**body, "stream": True}) as streamed:
            assert streamed.status_code == 200 and streamed.headers["x-weights-version"] == str(version)
            streamed.read()
    return r.json()["choices"][0]["token_ids"]


def _version(http) -> int:
    return http.get("/v1/models").json()["data"][0]["weights_version"]


@pytest.mark.slow
def test_routes_need_the_api_key(srv, checkpoint):
    for method, path in [("POST", "/v1/update_weights"), ("POST", "/sleep"), ("GET", "/is_sleeping"),
                         ("POST", "/v1/update_weights_from_distributed")]:
        r = httpx.request(method, srv.url + path, json={"path": checkpoint(ARCH, 1)}, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "AuthenticationError"


@pytest.mark.slow
def test_update_weights_route(http, checkpoint, reference_ids):
    old = reference_ids([PROMPT], 8, ARCH, 0)[0]
    new = reference_ids([PROMPT], 8, ARCH, 1)[0]
    start = _version(http)
    assert _generate(http, start) == old
    assert "x-weights-version" not in http.get("/v1/models").headers  # only generations carry it

    r = http.post("/v1/update_weights", json={"path": "/no/such/folder"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == "path" and "/no/such/folder" in error["message"]
    r = http.post("/v1/update_weights", json={"path": checkpoint("LlamaForCausalLM", 1)})
    assert r.status_code == 400 and "LlamaForCausalLM" in r.json()["error"]["message"]
    r = http.post("/v1/update_weights", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    r = http.post("/v1/update_weights_from_distributed", json={"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                               "shapes": [[64]]})
    assert r.status_code == 400 and "init_weight_update_group" in r.json()["error"]["message"]
    assert _version(http) == start
    assert _generate(http) == old

    r = http.post("/v1/update_weights", json={"path": checkpoint(ARCH, 1)})
    assert r.status_code == 200, r.text
    assert r.json()["weights_version"] == start + 1 == _version(http)
    assert _generate(http, start + 1) == new
    assert http.get("/v1/weights_info").json()["weights_version"] == start + 1


@pytest.mark.slow
def test_sleep_and_wake_up_routes(http, reference_ids):
    before = _generate(http)
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    r = http.post("/sleep", params={"level": 2})
    assert r.status_code == 200, r.text
    released = r.json()
    assert released["kv_cache_bytes"] > 0 and released["weights_bytes"] > 0
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    body = {"token_ids": PROMPT["prompt_token_ids"], "sampling_params": {"max_tokens": 2}}
    r = http.post("/inference/v1/generate", json=body)
    assert r.status_code == 400 and "sleeping" in r.json()["error"]["message"]
    assert http.post("/sleep", params={"level": 3}).status_code == 400
    r = http.post("/wake_up", params={"tags": "weights"})
    assert r.status_code == 200 and r.json()["weights_bytes"] == released["weights_bytes"]
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}  # the KV cache is still released
    r = http.post("/wake_up")
    assert r.status_code == 200 and r.json()["kv_cache_bytes"] == released["kv_cache_bytes"]
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _generate(http) == before


@pytest.mark.slow
def test_a_weight_update_group_address_must_be_allowed(http):
    for address in ("169.254.169.254", "10.1.2.3", "metadata.internal"):
        r = http.post("/v1/init_weight_update_group", json={"master_address": address, "master_port": 29999,
                                                            "world_size": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "master_address" and "--weight-update-allowed-addresses" in error["message"]
