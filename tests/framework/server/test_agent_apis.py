"""The Messages API (official `anthropic` client) and the Responses API (official `openai`
client) against a running server.

Two servers: one whose outputs are forced by a test-only logits processor (a <think> block
and a hermes tool call, so tool round trips and reasoning are under the test's control),
and one plain random Qwen3 (sampling, constrained tool calls, stop sequences, cancellation,
errors, key scoping, limits). Streamed results must accumulate to the non-streamed ones.
"""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest

from forced_outputs import forcing
from portaserve.framework.config import EngineConfig
from portaserve.framework.server.state import ServerSettings
from server_harness import ServerThread, metric, wait_for

pytestmark = pytest.mark.slow

REASONING = "I need the weather for Paris."
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
FORCED_TEXT = f"<think>\n{REASONING}\n</think>\n\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
          "additionalProperties": False}
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": SCHEMA},
                   {"name": "get_time", "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}]
OPENAI_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": SCHEMA},
                {"type": "function", "name": "get_time",
                 "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]
KEY_A, KEY_B = "key-a", "key-b"
BODY_LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    from portaserve.framework.engine.tokenizer import Tokenizer
    from portaserve.models.checkpoints import write_checkpoint

    ckpt = write_checkpoint("Qwen3ForCausalLM", "tiny", tmp_path_factory.mktemp("qwen3-forced"))
    tok = Tokenizer.from_pretrained(ckpt)
    ids = tok.encode(FORCED_TEXT, add_special_tokens=False)
    config = EngineConfig.create(model=str(ckpt), max_model_len=512, served_model_name="forced",
                                 logits_processors=["forced_outputs:ForceTokens"])
    settings = ServerSettings(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3",
                              response_store=str(tmp_path_factory.mktemp("store") / "responses.db"))
    with forcing(ids, tok.token_to_id("<|im_end|>")), ServerThread(config, settings) as server:
        yield server


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    from portaserve.models.checkpoints import write_checkpoint

    ckpt = write_checkpoint("Qwen3ForCausalLM", "tiny", tmp_path_factory.mktemp("qwen3"))
    config = EngineConfig.create(model=str(ckpt), max_model_len=512, served_model_name="tiny")
    settings = ServerSettings(api_keys=(KEY_A, KEY_B), served_model_names=("tiny", "claude-sonnet-x", "gpt-x"),
                              enable_auto_tool_choice=True, tool_call_parser="hermes",
                              max_request_body_bytes=BODY_LIMIT)
    with ServerThread(config, settings) as server:
        yield server


def claude(srv, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=120)


def oai(srv, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def blocks(message) -> list[tuple]:
    """A message's content without the generated ids."""
    out = []
    for b in message.content:
        if b.type == "text":
            out.append(("text", b.text))
        elif b.type == "thinking":
            out.append(("thinking", b.thinking))
        else:
            out.append((b.type, b.name, b.input))
    return out


def items(response) -> list[tuple]:
    """A response's output items without the generated ids."""
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        elif item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content or ())))
        else:
            out.append((item.type, item.name, json.loads(item.arguments)))
    return out


# ----- the forced server: reasoning, tool calls, round trips ---------------------------------------------


def test_messages_tool_use_streamed_and_not(forced):
    client = claude(forced)
    kwargs = dict(model="forced", max_tokens=200, system="You check the weather.", tools=ANTHROPIC_TOOLS,
                  messages=[{"role": "user", "content": "Weather in Paris?"}])
    full = client.messages.create(**kwargs)
    assert blocks(full) == [("thinking", REASONING), ("tool_use", "get_weather", CALL["arguments"])]
    assert full.stop_reason == "tool_use" and full.content[1].id.startswith("toolu_")
    events = []
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            events.append(event)
        final = stream.get_final_message()
    assert blocks(final) == blocks(full) and final.stop_reason == "tool_use"
    assert final.usage.output_tokens == full.usage.output_tokens
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_stop",
                                                  "message_delta", "message_stop")]
    assert kinds == ["message_start", "content_block_start", "content_block_stop", "content_block_start",
                     "content_block_stop", "message_delta", "message_stop"]
    thinking = "".join(e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
    args = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                   and e.delta.type == "input_json_delta")
    assert thinking == REASONING and json.loads(args) == CALL["arguments"]


def test_messages_tool_result_round_trip_and_count_tokens(forced):
    client = claude(forced)
    first = client.messages.create(model="forced", max_tokens=200, tools=ANTHROPIC_TOOLS, system="Be brief.",
                                   messages=[{"role": "user", "content": "Weather in Paris?"}])
    use = first.content[-1]
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees and sunny"}]},
    ]
    second = client.messages.create(model="forced", max_tokens=200, tools=ANTHROPIC_TOOLS, system="Be brief.",
                                    messages=conversation)
    assert second.stop_reason == "tool_use"
    counted = client.messages.count_tokens(model="forced", tools=ANTHROPIC_TOOLS, system="Be brief.",
                                           messages=conversation)
    assert counted.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens > 0  # the first turn's prompt was cached
    # the same conversation in chat-completions form renders to the same tokens
    chat_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": REASONING,
         "tool_calls": [{"id": use.id, "type": "function", "function": {"name": "get_weather",
                                                                         "arguments": json.dumps(CALL["arguments"])}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 degrees and sunny"},
    ]
    tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description"),
                                               "parameters": t["input_schema"]}} for t in ANTHROPIC_TOOLS]
    tokenized = httpx.post(forced.url + "/tokenize", json={"messages": chat_messages, "tools": tools}).json()
    assert tokenized["count"] == counted.input_tokens


def test_responses_function_call_round_trip(forced):
    client = oai(forced)
    first = client.responses.create(model="forced", input="Weather in Paris?", instructions="You check the weather.",
                                    tools=OPENAI_TOOLS, max_output_tokens=200)
    assert items(first) == [("reasoning", REASONING), ("function_call", "get_weather", CALL["arguments"])]
    assert first.status == "completed" and first.instructions == "You check the weather."
    call = first.output[1]
    second = client.responses.create(
        model="forced", previous_response_id=first.id, tools=OPENAI_TOOLS, max_output_tokens=200,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}])
    assert second.previous_response_id == first.id and second.status == "completed"
    # the stored conversation was replayed (without the first instructions, as in OpenAI's API)
    assert second.usage.input_tokens > first.usage.input_tokens
    listed = [i.type for i in client.responses.input_items.list(second.id).data]
    assert listed == ["message", "reasoning", "function_call", "function_call_output"]
    assert client.responses.retrieve(second.id).output[1].call_id == second.output[1].call_id


def test_responses_stream_accumulates_to_the_response(forced):
    client = oai(forced)
    kwargs = dict(model="forced", input="Weather in Paris?", tools=OPENAI_TOOLS, max_output_tokens=200)
    full = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:  # the SDK's strict accumulator checks the event order
        events = list(stream)
        final = stream.get_final_response()
    assert items(final) == items(full)
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert json.loads(args) == CALL["arguments"] and reasoning == REASONING
    assert client.responses.retrieve(final.id).status == "completed"  # streamed responses are stored too


# ----- the plain server ------------------------------------------------------------------------------------


def test_same_seed_streamed_equals_not_streamed(plain):
    client = claude(plain, KEY_A)
    kwargs = dict(model="tiny", max_tokens=24, messages=[{"role": "user", "content": "Tell me a story."}],
                  extra_body={"temperature": 1.0, "seed": 7})
    full = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert blocks(final) == blocks(full) and full.stop_reason == final.stop_reason == "max_tokens"
    assert full.usage.output_tokens == 24
    other = oai(plain, KEY_A)
    rkwargs = dict(model="tiny", input="Tell me a story.", max_output_tokens=24, temperature=1.0, extra_body={"seed": 7})
    response = other.responses.create(**rkwargs)
    text = "".join(e.delta for e in other.responses.create(stream=True, **rkwargs)
                   if e.type == "response.output_text.delta")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert text == response.output_text and text


def test_forced_tool_choice_is_constrained(plain):
    """A random model: `any` / `tool` / `required` must still give a valid call."""
    client = claude(plain, KEY_A)
    for choice, names in (({"type": "any"}, {"get_weather", "get_time"}), ({"type": "tool", "name": "get_weather"},
                                                                          {"get_weather"})):
        message = client.messages.create(model="tiny", max_tokens=200, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                                         messages=[{"role": "user", "content": "Weather?"}],
                                         extra_body={"temperature": 0.8, "seed": 1, "disable_any_whitespace": True})
        uses = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and uses and {u.name for u in uses} <= names
        for use in uses:
            if use.name == "get_weather":
                jsonschema.validate(use.input, SCHEMA)
    response = oai(plain, KEY_A).responses.create(model="tiny", input="Weather?", tools=OPENAI_TOOLS,
                                                  tool_choice={"type": "function", "name": "get_weather"},
                                                  max_output_tokens=200, extra_body={"seed": 2, "disable_any_whitespace": True})
    calls = [i for i in response.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)


def test_stop_sequences_and_model_names(plain):
    client = claude(plain, KEY_A)
    greedy = client.messages.create(model="claude-sonnet-x", max_tokens=24, extra_body={"temperature": 0},
                                    messages=[{"role": "user", "content": "Count."}])
    assert greedy.model == "claude-sonnet-x"  # one of --served-model-name's names
    text = greedy.content[0].text
    stop = text[8:11]
    stopped = client.messages.create(model="claude-sonnet-x", max_tokens=24, extra_body={"temperature": 0},
                                     stop_sequences=[stop], messages=[{"role": "user", "content": "Count."}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert text.startswith(stopped.content[0].text) and len(stopped.content[0].text) <= 8
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert err.value.body["error"]["type"] == "not_found_error"
    assert {m.id for m in client.models.list().data} == {"tiny", "claude-sonnet-x", "gpt-x"}
    assert oai(plain, KEY_A).models.retrieve("gpt-x").id == "gpt-x"


def test_errors_in_each_api_shape(plain):
    client = claude(plain, KEY_A)
    # a missing max_tokens (the client requires it: raw)
    r = httpx.post(plain.url + "/v1/messages", headers={"x-api-key": KEY_A},
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "max_tokens: this field is required"}}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="tiny", max_tokens=4, stop_sequences=["x" * 5000],
                               messages=[{"role": "user", "content": "x"}])
    assert err.value.body["error"]["message"].startswith("stop_sequences:")
    with pytest.raises(anthropic.AuthenticationError) as err:
        claude(plain, "wrong").messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert err.value.body["error"]["type"] == "authentication_error"
    # oversized: a 413 from the gateway, in each route's shape
    big = "x" * (BODY_LIMIT + 10)
    r = httpx.post(plain.url + "/v1/messages", headers={"x-api-key": KEY_A},
                   json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": big}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(plain.url + "/v1/responses", headers={"Authorization": f"Bearer {KEY_A}"},
                   json={"model": "tiny", "input": big})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    responses = oai(plain, KEY_A)
    with pytest.raises(openai.NotFoundError) as err:
        responses.responses.create(model="tiny", input="x", previous_response_id="resp_unknown")
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as err:
        responses.responses.create(model="tiny", input="x", tools=[{"type": "web_search_preview"}])
    assert err.value.body["param"] == "tools" and "hosted tool" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        responses.responses.create(model="tiny", input=[{"role": "user", "content": "x"}] * 3000)
    assert err.value.body["param"] == "input" and "--max-messages" in err.value.body["message"]
    # x-api-key works on every route, Bearer on the Messages routes
    assert httpx.get(plain.url + "/v1/models", headers={"x-api-key": KEY_B}).status_code == 200
    assert httpx.post(plain.url + "/v1/messages/count_tokens", headers={"Authorization": f"Bearer {KEY_B}"},
                      json={"messages": [{"role": "user", "content": "x"}]}).status_code == 200


def test_stored_responses_belong_to_their_key(plain):
    mine, theirs = oai(plain, KEY_A), oai(plain, KEY_B)
    response = mine.responses.create(model="gpt-x", input="Hello", max_output_tokens=4, metadata={"run": "1"})
    assert response.model == "gpt-x" and response.metadata == {"run": "1"}
    assert mine.responses.retrieve(response.id).output_text == response.output_text
    for call in (lambda: theirs.responses.retrieve(response.id), lambda: theirs.responses.delete(response.id),
                 lambda: theirs.responses.create(model="tiny", input="x", previous_response_id=response.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    mine.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(response.id)
    unstored = mine.responses.create(model="tiny", input="Hello", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(unstored.id)


def test_cancelling_a_response_in_progress(plain):
    client = oai(plain, KEY_A)
    headers = {"Authorization": f"Bearer {KEY_A}"}
    seen: dict = {}

    def consume():
        body = {"model": "tiny", "input": "Write a long story.", "max_output_tokens": 480, "stream": True,
                "extra": None}
        with httpx.stream("POST", plain.url + "/v1/responses", json=body, headers=headers, timeout=0.3) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    seen.setdefault("types", []).append(event["type"])
                    if event["type"] == "response.created":
                        seen["id"] = event["response"]["id"]
                    seen["last"] = event

    thread = threading.Thread(target=consume)
    thread.start()
    wait_for(lambda: "response.output_text.delta" in seen.get("types", ()), timeout=60)
    assert client.responses.retrieve(seen["id"]).status == "in_progress"
    cancelled = client.responses.cancel(seen["id"])
    thread.join(60)
    assert cancelled.status == "cancelled" and 0 < cancelled.usage.output_tokens < 480
    assert seen["last"]["type"] == "response.incomplete" and seen["last"]["response"]["status"] == "cancelled"
    assert client.responses.retrieve(seen["id"]).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # finished: nothing to cancel
        client.responses.cancel(seen["id"])
    wait_for(lambda: plain.engine.num_in_flight() == 0, timeout=30)


def test_metrics_count_the_new_routes(plain):
    text = httpx.get(plain.url + "/metrics", headers={"x-api-key": KEY_A}).text
    before = metric(text, "portaserve:request_success_total", model_name="tiny", finished_reason="length")
    claude(plain, KEY_A).messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "x"}])
    oai(plain, KEY_A).responses.create(model="tiny", input="x", max_output_tokens=3)
    time.sleep(0.2)
    text = httpx.get(plain.url + "/metrics", headers={"x-api-key": KEY_A}).text
    assert metric(text, "portaserve:request_success_total", model_name="tiny", finished_reason="length") == before + 2


def test_a_client_that_leaves_aborts_its_request(plain):
    headers = {"x-api-key": KEY_A}
    for path, body in (("/v1/responses", {"model": "tiny", "input": "Write a long story.", "max_output_tokens": 400}),
                       ("/v1/messages", {"model": "tiny", "max_tokens": 400,
                                         "messages": [{"role": "user", "content": "Write a long story."}]})):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(plain.url + path, json=body, headers=headers, timeout=0.3)
        assert wait_for(lambda: plain.engine.num_in_flight() == 0, timeout=30)
    # and the server goes on
    assert claude(plain, KEY_A).messages.create(model="tiny", max_tokens=2,
                                                messages=[{"role": "user", "content": "x"}]).usage.output_tokens == 2
