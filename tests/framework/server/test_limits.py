"""Every request-supplied size has a limit: over it is a 400 in OpenAI's error shape that
names the parameter, the limit and its flag, answered before any work is queued (the
huge-`n` request that once grew the server to 23.6 GB is answered at once, with the
server's memory unchanged)."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from portaserve.framework.config import EngineConfig
from portaserve.framework.errors import InvalidParameterError
from portaserve.framework.server.limits import RequestLimits
from portaserve.framework.server.state import ServerSettings
from server_harness import ServerThread

LIMITS = RequestLimits(max_n=4, max_prompts=3, max_sequences=6, max_stop_strings=2, max_stop_string_chars=8,
                       max_logit_bias=2, max_stop_token_ids=2, max_tools=1, max_tools_bytes=400, max_messages=3,
                       max_embedding_inputs=2, max_token_ids=40, max_prompt_logprob_entries=30,
                       max_chat_template_kwargs_bytes=40, max_chat_template_bytes=200, chat_template_timeout=2.0)
MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    from portaserve.models.checkpoints import write_checkpoint

    ckpt = write_checkpoint("Qwen2ForCausalLM", "tiny", tmp_path_factory.mktemp("qwen2"))
    config = EngineConfig.create(model=str(ckpt), max_model_len=512, served_model_name="tiny")
    settings = ServerSettings(limits=LIMITS, trust_request_chat_template=True, enable_auto_tool_choice=True,
                              tool_call_parser="hermes")
    with ServerThread(config, settings) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


CASES = [
    ("/v1/completions", {"prompt": "hi", "n": 4557668817848036666703347712, "max_tokens": 2}, "n", "--max-n"),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d"], "max_tokens": 2}, "prompt", "--max-prompts"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2}, "n", "--max-sequences"),
    ("/v1/completions", {"prompt": [[1] * 41], "max_tokens": 2}, "prompt", "--max-token-ids"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, "stop", "--max-stop-strings"),
    ("/v1/completions", {"prompt": "hi", "stop": "123456789"}, "stop", "--max-stop-string-chars"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias", "--max-logit-bias"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1, 2, 3]}, "stop_token_ids", "--max-stop-token-ids"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": list(range(41))}, "allowed_token_ids",
     "--max-token-ids"),
    ("/v1/completions", {"prompt": [[1] * 20], "prompt_logprobs": 1}, "prompt_logprobs",
     "--max-prompt-logprob-entries"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 513}, "truncate_prompt_tokens", "512"),
    ("/v1/chat/completions", {"messages": MESSAGES * 4}, "messages", "--max-messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL, TOOL]}, "tools", "--max-tools"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{**TOOL, "function": {**TOOL["function"],
     "description": "x" * 500}}]}, "tools", "--max-tools-bytes"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"a": "x" * 50}}, "chat_template_kwargs",
     "--max-chat-template-kwargs-bytes"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template": "{{ 'x' }}" * 30}, "chat_template",
     "--max-chat-template-bytes"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 5}, "n", "--max-n"),
    ("/v1/embeddings", {"input": ["a", "b", "c"]}, "input", "--max-embedding-inputs"),
    ("/tokenize", {"messages": MESSAGES * 4}, "messages", "--max-messages"),
    ("/detokenize", {"tokens": [1] * 41}, "tokens", "--max-token-ids"),
    ("/inference/v1/generate", {"token_ids": [1] * 41}, "token_ids", "--max-token-ids"),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"n": 5}}, "n", "--max-n"),
]


@pytest.mark.grid(keep=6)
@pytest.mark.parametrize(("route", "body", "param", "words"), CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_over_a_limit_is_a_400_naming_it(http, route, body, param, words):
    start = time.monotonic()
    r = http.post(route, json={"model": "tiny", **body})
    assert time.monotonic() - start < 1.0
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "BadRequestError" or error["code"] == 400


def test_huge_n_leaves_the_servers_memory_unchanged(http):
    before = rss_bytes()
    for n in (100000, 4557668817848036666703347712):
        assert http.post("/v1/completions", json={"prompt": "hi", "n": n, "max_tokens": 2}).status_code == 400
    assert rss_bytes() - before < 20 * 2**20
    ok = http.post("/v1/completions", json={"prompt": "hi", "n": 4, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_within_the_limits_is_served(http):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES * 3, "tools": [TOOL], "max_tokens": 2, "n": 2,
                                                 "stop": ["ab", "cd"], "logit_bias": {"5": 1.0}})
    assert r.status_code == 200, r.text


def test_limits_must_be_positive():
    with pytest.raises(InvalidParameterError, match="max_n"):
        RequestLimits(max_n=0)


def test_every_limit_is_a_serve_flag_with_its_default_in_help():
    from portaserve.framework.cli import build_parser
    from portaserve.framework.cli.serve import server_settings

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    help_text = " ".join(serve.format_help().split())
    for name, _, _, default in RequestLimits.flag_help():
        flag = "--" + name.replace("_", "-")
        assert flag in help_text
        after = help_text[help_text.rindex(flag + " "):]  # the options section, not the usage line
        assert f"(default: {default})" in after[:400], flag
    limits = server_settings(parser.parse_args(["serve", "--max-n", "7", "--max-token-ids", "99"])).limits
    assert limits.max_n == 7 and limits.max_token_ids == 99 and limits.max_prompts == RequestLimits().max_prompts


@pytest.mark.slow
def test_a_request_template_that_renders_too_long_is_stopped(http):
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}x"
    start = time.monotonic()
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template": endless, "max_tokens": 2})
    elapsed = time.monotonic() - start
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template" and "--chat-template-timeout" in error["message"]
    assert elapsed < LIMITS.chat_template_timeout + 10
    # the next request-supplied template renders in a fresh worker
    ok = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": "{{ messages[0]['content'] }}!"})
    assert ok.status_code == 200 and ok.json()["count"] >= 1
    bad = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": "{{ messages.append(1) }}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"


def test_the_openapi_schema_states_the_limits_and_the_model_names(http):
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["model"]["anyOf"][0]["enum"] == ["tiny"]
    n = next(b for b in chat["n"].get("anyOf", [chat["n"]]) if b.get("type") == "integer")
    assert n["maximum"] == LIMITS.max_n and n["minimum"] == 1
    assert next(b for b in chat["messages"].get("anyOf", [chat["messages"]]) if b.get("type") == "array")["maxItems"] == 3
    stop = {b.get("type"): b for b in chat["stop"]["anyOf"]}
    assert stop["string"]["maxLength"] == 8 and stop["array"]["maxItems"] == 2
    generate = schemas["GenerateRequest"]["properties"]["token_ids"]
    assert generate["maxItems"] == LIMITS.max_token_ids and generate["items"]["maximum"] > 0
