"""Forced tool calls enforced while sampling, on a random-weight model (temperature 1.0):
whatever the model would say, the calls parse and their arguments follow the tool's
parameter schema (checked with jsonschema), in the hermes parser's format and in vLLM's
JSON list when no parser is set."""

from __future__ import annotations

import json

import openai
import pytest

from portaserve.framework.config import EngineConfig
from portaserve.framework.server.state import ServerSettings

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris, and the time there?"}]


@pytest.fixture(scope="module", params=["hermes", None], ids=["hermes-format", "json-list-without-parser"])
def client(request, tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from server_harness import ServerThread
    from portaserve.models.checkpoints import write_checkpoint

    folder = write_checkpoint("Qwen2ForCausalLM", "tiny", tmp_path_factory.mktemp("qwen2"), 2)
    config = EngineConfig.create(model=str(folder), served_model_name="m", dtype="float32")
    # with a parser the calls are constrained to its format and read back by it; without
    # one, to vLLM's JSON list
    with ServerThread(config, ServerSettings(tool_call_parser=request.param)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


pytestmark = pytest.mark.slow  # a server


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_gives_valid_calls(client, parallel):
    for seed in range(3):
        resp = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=250,
                                              extra_body={"disable_any_whitespace": True})
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        check_calls(choice.message.tool_calls)
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_named_function_is_called_with_valid_arguments_streamed_or_not(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=named, seed=1,
                                          temperature=1.0, max_tokens=100, extra_body={"disable_any_whitespace": True})
    assert resp.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in resp.choices[0].message.tool_calls] == ["get_time"]
    check_calls(resp.choices[0].message.tool_calls)
    stream = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=named, seed=1,
                                            temperature=1.0, max_tokens=100, stream=True,
                                            extra_body={"disable_any_whitespace": True})
    deltas = [c.choices[0].delta for c in stream if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments) == json.loads(resp.choices[0].message.tool_calls[0].function.arguments)
