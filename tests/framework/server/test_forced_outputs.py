"""Reasoning and tool-call parsing in the server, on outputs forced by a test-only logits
processor (``--logits-processors forced_outputs:ForceTokens``): every request writes a
<think> block and a hermes tool call with a random Qwen3 checkpoint. Streaming and
non-streaming must give the same message. The module ends by killing the engine."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from forced_outputs import forcing
from portaserve.framework.config import EngineConfig
from portaserve.framework.server.state import ServerSettings
from server_harness import ServerThread, wait_for

REASONING = "I need the weather for Paris."
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
FORCED_TEXT = f"<think>\n{REASONING}\n</think>\n\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


# a server of its own whose outputs are forced: the full suite (the parsers' unit tests
# are in test_parsers.py, in the fast tier)
pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from portaserve.framework.engine.tokenizer import Tokenizer
    from portaserve.models.checkpoints import write_checkpoint

    ckpt = write_checkpoint("Qwen3ForCausalLM", "tiny", tmp_path_factory.mktemp("qwen3"))
    tok = Tokenizer.from_pretrained(ckpt)
    ids = tok.encode(FORCED_TEXT, add_special_tokens=False)
    assert tok.decode(ids) == FORCED_TEXT  # <think> and <tool_call> are not special: they survive decoding
    config = EngineConfig.create(model=str(ckpt), max_model_len=512, served_model_name="forced",
                                 logits_processors=["forced_outputs:ForceTokens"])
    settings = ServerSettings(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    with forcing(ids, tok.token_to_id("<|im_end|>")), ServerThread(config, settings) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def message_of(response):
    choice = response.choices[0]
    m = choice.message.model_dump()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
    return m.get("reasoning_content"), m.get("content"), calls, choice.finish_reason


def streamed_message(chunks):
    reasoning, content, calls, finish = [], [], {}, None
    for chunk in chunks:
        for ch in chunk.choices:
            d = ch.delta.model_dump()
            reasoning.append(d.get("reasoning_content") or "")
            content.append(d.get("content") or "")
            for call in d.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"name": "", "arguments": "", "ids": set()})
                fn = call.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
                if call.get("id"):
                    slot["ids"].add(call["id"])
            finish = ch.finish_reason or finish
    for slot in calls.values():
        assert len(slot["ids"]) == 1  # one id per call
    ordered = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    return "".join(reasoning) or None, "".join(content) or None, ordered, finish


def both(client, **kwargs):
    full = message_of(client.chat.completions.create(model="forced", messages=MESSAGES, **kwargs))
    streamed = streamed_message(client.chat.completions.create(model="forced", messages=MESSAGES, stream=True, **kwargs))
    return full, streamed


def test_the_processor_forces_the_text(client):
    out = client.completions.create(model="forced", prompt="anything", max_tokens=200)
    assert out.choices[0].text == FORCED_TEXT
    assert out.choices[0].finish_reason == "stop"


def test_tool_call_and_reasoning_auto(client):
    full, streamed = both(client, tools=TOOLS, max_tokens=200)
    assert full == streamed
    reasoning, content, calls, finish = full
    assert reasoning == REASONING
    assert content is None
    assert [(name, json.loads(args)) for name, args in calls] == [("get_weather", CALL["arguments"])]
    assert finish == "tool_calls"


def test_no_tools_means_no_tool_parsing(client):
    full, streamed = both(client, max_tokens=200)
    assert full == streamed
    assert full == (REASONING, f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>", [], "stop")


def test_tool_choice_none_keeps_the_text(client):
    full, streamed = both(client, tools=TOOLS, tool_choice="none", max_tokens=200)
    assert full == streamed
    assert full[1].startswith("<tool_call>") and full[2] == [] and full[3] == "stop"


def test_named_tool_choice_must_name_a_tool(client):
    # (a named choice is constrained while sampling: tests/framework/structured/test_tool_calls.py)
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model="forced", messages=MESSAGES, tools=TOOLS, max_tokens=5,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_include_reasoning_false_and_template_kwargs(client):
    full, streamed = both(client, max_tokens=200, extra_body={"include_reasoning": False,
                                                              "chat_template_kwargs": {"enable_thinking": False}})
    assert full == streamed
    assert full[0] is None and full[1].startswith("<tool_call>")


def test_truncated_reasoning_stream_equals_whole(client):
    # cut inside the <think> block: all reasoning, no content, in both modes
    full, streamed = both(client, max_tokens=5)
    assert full == streamed
    assert full[1] is None and full[3] == "length" and REASONING.startswith(full[0])


def test_engine_death_mid_stream(srv, client):
    """Last in the module: kill the engine process while a request streams."""
    stream = client.chat.completions.create(model="forced", messages=MESSAGES, stream=True, max_tokens=400,
                                            extra_body={"ignore_eos": True})
    got = 0
    with pytest.raises(openai.APIError, match="engine is dead"):
        for chunk in stream:
            got += 1
            if got == 3:
                srv.engine._proc.kill()
    assert wait_for(lambda: httpx.get(srv.url + "/health").status_code == 500, 20)
    body = httpx.get(srv.url + "/health").json()
    assert "dead" in body["error"]["message"] and "Traceback" not in body["error"]["message"]
    with pytest.raises(openai.InternalServerError, match="engine is dead"):
        client.chat.completions.create(model="forced", messages=MESSAGES, max_tokens=3)
