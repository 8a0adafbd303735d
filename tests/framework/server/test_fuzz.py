"""schemathesis fuzzes every route of the running server's /openapi.json (the Messages and
Responses APIs included), with and without the API key, within a bounded time: no request
may get a 5xx, every 4xx is in the route's API's error shape (Anthropic's on /v1/messages,
OpenAI's elsewhere), and the server answers a normal chat afterwards. The admin routes stay off
(a fuzzer must never make the server connect to an address it generated)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from portaserve.framework.config import EngineConfig
from portaserve.framework.server.state import ServerSettings
from server_harness import ServerThread

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KEY = "fuzz-key"
#: seconds schemathesis may spend per run (two runs: with and without the key)
FUZZ_SECONDS = int(os.environ.get("PORTASERVE_FUZZ_SECONDS", "90"))
# A fixed seed keeps CI's run reproducible (a finding fails the same way again); explore
# further with PORTASERVE_FUZZ_SEED=<another number>, as a developer or a soak job.
FUZZ_SEED = int(os.environ.get("PORTASERVE_FUZZ_SEED", "0"))


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from portaserve.models.checkpoints import write_checkpoint

    ckpt = write_checkpoint("Qwen2ForCausalLM", "tiny", tmp_path_factory.mktemp("qwen2"))
    config = EngineConfig.create(model=str(ckpt), max_model_len=256, served_model_name="tiny", max_num_seqs=16)
    settings = ServerSettings(api_keys=(KEY,), max_request_body_bytes=256 * 1024)
    with ServerThread(config, settings) as server:
        yield server


def schemathesis_cli() -> list[str]:
    found = shutil.which("st", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("schemathesis is not installed (it is in the test extra)")
    return [found]


def fuzz(srv, tmp_path: Path, with_key: bool) -> list[dict]:
    """Run schemathesis; returns the recorded exchanges (its HAR-like ndjson report)."""
    report = tmp_path / ("with-key.har" if with_key else "without-key.har")
    # the schema itself is behind the key: fetch it once, fuzz the server with or without it
    schema = tmp_path / "openapi.json"
    schema.write_text(httpx.get(srv.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).text)
    cmd = schemathesis_cli() + [
        "--no-color", "run", str(schema), "--url", srv.url,
        "--checks", "not_a_server_error",
        "--max-time", str(FUZZ_SECONDS), "--workers", "2", "--request-timeout", "60",
        "--report", "har", "--report-har-path", str(report), "--suppress-health-check", "all",
        # (its "coverage" phase crashed inside schemathesis 4.32: an AST recursion SystemError)
        "--phases", "examples,fuzzing", "--generation-database", "none", "--seed", str(FUZZ_SEED),
    ]
    if with_key:
        cmd += ["-H", f"Authorization: Bearer {KEY}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=FUZZ_SECONDS * 4 + 120)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    return json.loads(report.read_text())["log"]["entries"]


def check_exchanges(entries: list[dict]) -> None:
    assert entries, "schemathesis recorded no requests"
    statuses = [e["response"]["status"] for e in entries]
    assert not [s for s in statuses if s >= 500]
    for entry in entries:
        status = entry["response"]["status"]
        if 400 <= status < 500:
            text = entry["response"]["content"].get("text") or ""
            body = json.loads(text)
            error = body["error"]
            if "/v1/messages" in entry["request"]["url"]:  # Anthropic's shape on its routes
                assert body["type"] == "error" and error["type"] and error["message"], entry
            else:
                assert error["code"] == status and isinstance(error["message"], str) and error["message"], entry


@pytest.mark.parametrize("with_key", [True, False], ids=["with-key", "without-key"])
def test_fuzzing_finds_no_server_error(srv, tmp_path, with_key):
    entries = fuzz(srv, tmp_path, with_key)
    check_exchanges(entries)
    if not with_key:
        assert {e["response"]["status"] for e in entries if not e["request"]["url"].endswith("/health")} <= {401}
    else:
        assert any(200 <= e["response"]["status"] < 300 for e in entries)  # valid requests were generated too
    # the server is alive and serves a normal chat
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert httpx.get(srv.url + "/health").status_code == 200
    stats = srv.engine.latest_stats
    assert stats is None or stats.kv_cache_usage == 0.0 or stats.num_running > 0
