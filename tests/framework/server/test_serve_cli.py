"""`portaserve serve` as users run it (a subprocess on the default model, SmolLM2-135M-Instruct:
the README's run command and curl example), the flag table, and the `chat` / `complete` API client."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from portaserve.framework.cli import build_parser
from portaserve.framework.cli.serve import FLAGS, engine_kwargs, server_settings
from portaserve.framework.config import EngineConfig
from server_harness import free_port

README = Path(__file__).resolve().parents[3] / "README.md"
PORTASERVE = str(Path(sys.executable).parent / "portaserve")


def readme_serve_section() -> str:
    text = README.read_text()
    start = text.index("## `portaserve serve`")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def readme_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", readme_serve_section(), re.S)


# ----- the flag table -----------------------------------------------------------------------------


def test_every_engine_config_field_has_a_flag_with_help():
    engine_flags = {f.dest for f in FLAGS if f.target == "engine"}
    assert set(EngineConfig.model_fields) - {"model"} <= engine_flags
    assert all(f.help for f in FLAGS)
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--dtype", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--enable-prefix-caching", "--no-enable-prefix-caching", "--kv-cache-memory",
                 "--tensor-parallel-size", "--chat-template", "--enable-auto-tool-choice", "--tool-call-parser",
                 "--reasoning-parser", "--allowed-origins", "--enable-request-id-headers", "--strict-plugins",
                 "--block-size", "--seed", "--attention-backend", "--quantization", "--kv-cache-dtype", "--enforce-eager",
                 "--compilation-mode", "--max-logprobs", "--logits-processors", "--distributed-executor-backend"):
        assert flag in help_text, flag


def test_flags_to_config_and_settings(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    args = build_parser().parse_args(shlex.split(
        f"serve /models/x --device cpu --max-model-len 256 --no-enable-prefix-caching --dtype float32 "
        f"--served-model-name a b --api-key k1 k2 --logits-processors m:C --kv-cache-memory 0.5 "
        f"--chat-template {template} --allowed-origins http://a.test,http://b.test --enable-request-id-headers "
        f"--limit-mm-per-prompt '{{\"image\": 3}}' --allowed-media-domains img.test cdn.test "
        f"--allowed-local-media-path {tmp_path} --response-store {tmp_path}/r.db --max-stored-responses 7"))
    config = EngineConfig.create(**engine_kwargs(args))
    assert (config.model, config.device, config.max_model_len, config.enable_prefix_caching) == ("/models/x", "cpu", 256, False)
    assert (config.dtype, config.served_model_name, config.logits_processors) == ("float32", "a", ["m:C"])
    assert config.kv_cache_memory == 0.5 and config.max_num_seqs == EngineConfig().max_num_seqs  # absent: the default
    settings = server_settings(args)
    assert settings.api_keys == ("k1", "k2") and settings.served_model_names == ("a", "b")
    assert settings.chat_template == "{{ messages[0].content }}"
    assert settings.allowed_origins == ("http://a.test", "http://b.test") and settings.enable_request_id_headers
    assert config.limit_mm_per_prompt == {"image": 3}
    assert settings.allowed_media_domains == ("img.test", "cdn.test") and settings.allowed_local_media_path == str(tmp_path)
    assert settings.response_store == f"{tmp_path}/r.db" and settings.max_stored_responses == 7


@pytest.mark.parametrize("argv,words", [
    (["--tool-call-parser", "nope"], ["tool_call_parser", "hermes", "llama3_json"]),
    (["--enable-auto-tool-choice"], ["--tool-call-parser"]),
    (["--reasoning-parser", "nope"], ["deepseek_r1", "qwen3"]),
    (["--max-num-seqs", "0"], ["max_num_seqs"]),
    (["--max-prefill-tokens-with-decodes", "-2"], ["max_prefill_tokens_with_decodes", ">= 0"]),
    (["--logits-processors", "no_such_module:X"], ["logits_processors", "no_such_module"]),
    (["--limit-mm-per-prompt", "4"], ["limit_mm_per_prompt", "JSON object"]),
    (["--limit-mm-per-prompt", '{"video": 1}'], ["limit_mm_per_prompt", "'image'"]),
    (["--max-stored-responses", "0"], ["max_stored_responses", ">= 1"]),
])
def test_bad_flags_fail_before_the_engine_starts(argv, words, capsys):
    from portaserve.framework.cli import main

    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err


# ----- the README's commands ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    run_cmd = readme_blocks()[0].strip()
    assert run_cmd == "portaserve serve"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [PORTASERVE, *shlex.split(run_cmd)[1:], "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    seen = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = httpx.get(url + "/health", timeout=5).status_code
                if not seen or seen[-1] != status:
                    seen.append(status)
                if status == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        assert seen and seen[-1] == 200, (seen, proc.poll())
        yield port, url, seen, proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_health_is_503_while_loading_then_200(served):
    _, _, seen, _ = served
    assert seen == [503, 200]


@pytest.mark.slow
def test_readme_curl_example(served):
    port, url, _, _ = served
    curl = [b for b in readme_blocks() if b.lstrip().startswith("curl")][0]
    curl = curl.replace("localhost:8000", f"127.0.0.1:{port}")
    r = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert "Paris" in body["choices"][0]["message"]["content"]
    card = httpx.get(url + "/v1/models").json()["data"][0]
    assert card["id"] == "SmolLM2-135M-Instruct" and card["demo"] is False and card["root"].endswith(".gguf")


@pytest.mark.slow
def test_the_default_model_answers_through_the_official_client(served):
    import openai

    _, url, _, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=32,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    )
    assert "Paris" in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"
    assert reply.model == "SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_the_default_model_answers_alike_through_all_three_apis(served):
    """Chat Completions, the Responses API (openai client) and the Messages API (anthropic
    client): one pipeline underneath, so greedy answers are the same text."""
    import anthropic
    import openai

    _, url, _, _ = served
    question = "What is the capital of France? Answer in one sentence."
    oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chat = oa.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=32,
                                      messages=[{"role": "user", "content": question}])
    response = oa.responses.create(model="SmolLM2-135M-Instruct", temperature=0, max_output_tokens=32, input=question)
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    message = claude.messages.create(model="SmolLM2-135M-Instruct", max_tokens=32, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": question}])
    answer = chat.choices[0].message.content
    assert "Paris" in answer
    assert response.output_text == answer and response.status == "completed"
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == answer
    assert message.stop_reason == "end_turn"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == message.usage.output_tokens == chat.usage.completion_tokens


@pytest.mark.slow
def test_api_client_chat_and_complete(served, capsys, monkeypatch):
    import io

    from portaserve.framework.cli import main

    _, url, _, _ = served
    base = ["--base-url", url + "/v1", "--max-tokens", "4", "--temperature", "0"]
    one = subprocess.run([PORTASERVE, "chat", *base, "--message", "Hello"], capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    assert one.stdout.strip()
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nHow are you?\n"))
    assert main(["chat", *base]) == 0
    out = capsys.readouterr().out
    assert out.startswith(one.stdout) and out[len(one.stdout):].strip()  # greedy: the same first answer, then a second
    assert main(["complete", *base, "Once upon a time"]) == 0
    streamed = capsys.readouterr().out
    assert main(["complete", *base, "--no-stream", "Once upon a time"]) == 0
    assert capsys.readouterr().out == streamed and streamed.strip()
    assert main(["complete", "--base-url", "http://127.0.0.1:9/v1", "x"]) == 1
    assert "cannot talk to" in capsys.readouterr().err


@pytest.mark.slow
def test_startup_prints_the_plan_and_the_url(served):
    port, _, _, proc = served
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert "ExecutionPlan" in out and "platform" in out
    assert re.search(r"prefill_cap\s+96 prompt tokens\s+\(platform cpu's measured serving default", out), out
    assert f"http://127.0.0.1:{port}/v1" in out
    assert "RANDOM WEIGHTS" not in out and "GGUF file" in out and "'SmolLM2-135M-Instruct'" in out
    assert proc.returncode == 0
