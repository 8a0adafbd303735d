"""The Messages and Responses APIs' translation into chat requests, their stop-reason and
error mapping, and the stored-response stores (no server: fast tier)."""

from __future__ import annotations

import json

import pytest

from portaserve.framework.errors import InvalidParameterError
from portaserve.framework.server import messages_translate as mt
from portaserve.framework.server import responses_translate as rt
from portaserve.framework.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from portaserve.framework.server.errors import error_body_for
from portaserve.framework.server.protocol import NamedToolChoice
from portaserve.framework.server.response_store import MemoryResponseStore, SqliteResponseStore, StoredResponse
from portaserve.framework.server.responses_protocol import ResponsesRequest
from portaserve.framework.server.serving_messages import stop_reason_of

TOOL = {"name": "get_weather", "description": "weather", "input_schema": {"type": "object", "properties": {
    "city": {"type": "string"}}}}


def messages_request(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"max_tokens": 16, **kw})


# ----- Anthropic Messages -> chat ------------------------------------------------------------------------


def test_a_tool_round_trip_becomes_chat_messages():
    req = messages_request(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "Use tools."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should call the tool.", "signature": "x"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "text", "text": "Thanks."},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]}]},
        ],
        tools=[TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["\n\n"],
        thinking={"type": "enabled", "budget_tokens": 2048}, metadata={"user_id": "u"},
    )
    chat = mt.to_chat_request(req)
    assert chat.messages == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        # the result answers the call, before the user's words of that turn
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "user", "content": "Thanks."},
    ]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == TOOL["input_schema"]
    assert chat.stop == ["\n\n"] and chat.max_completion_tokens == 16
    assert chat.chat_template_kwargs == {"enable_thinking": True}


def test_tool_choices_and_images():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    chat = mt.to_chat_request(messages_request(
        messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}],
        tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"}))
    assert chat.messages[0]["content"] == [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                           {"type": "text", "text": "What is it?"}]
    assert isinstance(chat.tool_choice, NamedToolChoice) and chat.tool_choice.function.name == "get_weather"
    for kind, expected in (("auto", "auto"), ("none", "none")):
        chat = mt.to_chat_request(messages_request(messages=[{"role": "user", "content": "x"}], tools=[TOOL],
                                                   tool_choice={"type": kind}))
        assert chat.tool_choice == expected


@pytest.mark.parametrize("body, param, words", [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages", "'document'"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages", "must be 'user' or 'assistant'"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{**TOOL, "type": "web_search_20250305"}]}, "tools",
     "server tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}, "tool_choice", "name"),
    ({"messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"url": "x"}]}, "mcp_servers", "MCP"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages", "'file' is not supported"),
])
def test_unsupported_messages_input_names_the_field(body, param, words):
    with pytest.raises(InvalidParameterError) as err:
        mt.to_chat_request(messages_request(**body))
    assert err.value.param == param and words in str(err.value)
    assert str(err.value).startswith(param)  # named once, at the start


def test_chat_side_errors_name_the_messages_field():
    err = InvalidParameterError("stop", "stop: a stop string's length, 5000 exceeds the server's limit")
    renamed = mt.renamed_error(err, mt.RENAMED)
    assert renamed.param == "stop_sequences" and str(renamed).startswith("stop_sequences: a stop string")


def test_count_tokens_takes_no_max_tokens():
    req = CountTokensRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert mt.to_chat_request(req).max_completion_tokens is None


@pytest.mark.parametrize("finish, stop, calls, expected", [
    ("stop", None, 0, ("end_turn", None)),
    ("stop", 151645, 0, ("end_turn", None)),  # a stop token id
    ("stop", "\n\n", 0, ("stop_sequence", "\n\n")),
    ("length", None, 0, ("max_tokens", None)),
    ("stop", None, 2, ("tool_use", None)),
])
def test_stop_reasons(finish, stop, calls, expected):
    assert stop_reason_of(finish, stop, calls) == expected


def test_error_shape_follows_the_route():
    assert error_body_for("/v1/messages", 400, "bad") == {"type": "error", "error": {"type": "invalid_request_error",
                                                                                     "message": "bad"}}
    assert error_body_for("/v1/messages/count_tokens", 413, "big")["error"]["type"] == "request_too_large"
    assert error_body_for("/v1/messages", 401, "key")["error"]["type"] == "authentication_error"
    assert error_body_for("/v1/messages", 503, "loading")["error"]["type"] == "api_error"
    assert error_body_for("/v1/responses", 404, "gone")["error"]["code"] == 404
    assert "type" not in error_body_for("/v1/messagesX", 400, "x")  # only the Messages routes


# ----- Responses -> chat --------------------------------------------------------------------------------


def test_items_become_one_assistant_turn_per_model_turn():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                         {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "call it"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "20C"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "18C and 20C."}]},
        {"role": "user", "content": "Thanks"},
    ]
    assert rt.items_to_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "call it", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "20C"},
        {"role": "assistant", "content": "18C and 20C."},
        {"role": "user", "content": "Thanks"},
    ]


def test_responses_request_settings():
    req = ResponsesRequest.model_validate({
        "input": "hi", "instructions": "Be brief.", "max_output_tokens": 32, "temperature": 0.5, "seed": 3,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}],
        "tool_choice": {"type": "function", "name": "f"}, "reasoning": {"effort": "low"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}}})
    chat = rt.to_chat_request(req, rt.input_items(req.input))
    assert chat.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert chat.max_completion_tokens == 32 and chat.seed == 3 and chat.reasoning_effort == "low"
    assert chat.tool_choice.function.name == "f" and chat.tools[0].function.name == "f"
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == {"type": "object"}


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "tools", "hosted tool 'web_search_preview'"),
    ({"input": "x", "tools": [{"type": "code_interpreter"}]}, "tools", "hosted tool"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "hosted tools"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input", "'input_file'"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text", "'yaml'"),
])
def test_unsupported_responses_input_names_the_field(body, param, words):
    req = ResponsesRequest.model_validate(body)
    with pytest.raises(InvalidParameterError) as err:
        rt.to_chat_request(req, rt.input_items(req.input))
    assert err.value.param == param and words in str(err.value)


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({}, "input"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
])
def test_responses_fields_that_cannot_be_honoured(body, param):
    with pytest.raises(InvalidParameterError) as err:
        ResponsesRequest.model_validate(body).unsupported_fields()
    assert err.value.param == param


# ----- stores ---------------------------------------------------------------------------------------------


def record(n: int, size: int = 10) -> StoredResponse:
    return StoredResponse({"id": f"resp_{n}", "pad": "x" * size}, [{"type": "message", "role": "user", "content": "hi"}])


@pytest.fixture(params=["memory", "sqlite"])
def make(request, tmp_path):
    def make(**kw):
        if request.param == "memory":
            return MemoryResponseStore(**kw)
        return SqliteResponseStore(str(tmp_path / "responses.db"), **kw)
    return make


def test_stores_are_scoped_by_owner(make):
    store = make(max_responses=10, max_bytes=10**6)
    store.put("alice", "resp_1", record(1))
    assert store.get("alice", "resp_1") == record(1)
    assert store.get("bob", "resp_1") is None
    assert not store.delete("bob", "resp_1") and store.get("alice", "resp_1") is not None
    assert store.delete("alice", "resp_1") and store.get("alice", "resp_1") is None


def test_stores_are_bounded(make):
    store = make(max_responses=3, max_bytes=10**6)
    for n in range(10):
        store.put("", f"resp_{n}", record(n))
    assert len(store) == 3
    assert [store.get("", f"resp_{n}") is not None for n in range(10)] == [False] * 7 + [True] * 3
    small = make(max_responses=100, max_bytes=1000)
    for n in range(10):
        small.put("", f"resp_{n}", record(n, size=300))
    assert 1 <= len(small) <= 3  # each record is over 300 bytes
    small.put("", "huge", record(99, size=5000))  # larger than the whole store: not kept
    assert small.get("", "huge") is None


def test_the_sqlite_store_survives_a_restart(tmp_path):
    path = str(tmp_path / "responses.db")
    store = SqliteResponseStore(path)
    store.put("k", "resp_1", record(1))
    store.close()
    again = SqliteResponseStore(path)
    assert again.get("k", "resp_1") == record(1)
    again.close()


@pytest.mark.parametrize("items", [
    [{"role": {"x": 1}, "content": "x"}],
    [{"type": "reasoning", "content": 5, "summary": "x"}, {"role": "user", "content": "x"}],
    [{"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}],
    [{"type": "function_call_output", "call_id": "c", "output": {"x": 1}}],
    [{"role": "user", "content": [{"type": "input_text", "text": 5}]}],
    [{"role": "user", "content": 5}],
])
def test_malformed_items_are_400s_not_crashes(items):
    try:
        rt.items_to_messages(items)
    except InvalidParameterError as exc:
        assert exc.param == "input"


def test_malformed_blocks_are_400s_not_crashes():
    with pytest.raises(InvalidParameterError):
        mt.to_chat_request(messages_request(messages=[{"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]}]))
