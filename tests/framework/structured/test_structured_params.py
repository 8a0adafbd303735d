"""The request surface of structured outputs: OpenAI's response_format, vLLM's
structured_outputs object and guided_* fields, SamplingParams(structured_outputs=...),
and the errors that name the field."""

from __future__ import annotations

import pytest

from portaserve.framework.engine.params import SamplingParams
from portaserve.framework.errors import InvalidParameterError
from portaserve.framework.interfaces.structured_output import Constraint
from portaserve.framework.server.protocol import ChatCompletionRequest, CompletionRequest
from portaserve.framework.structured.params import MAX_SPEC_BYTES, StructuredOutputsParams, from_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)


@pytest.mark.parametrize("fields, constraint", [
    ({"response_format": {"type": "json_object"}}, Constraint("json_object", "")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     Constraint("json", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}')),
    ({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}}, Constraint("regex", "[a-z]+", True)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, Constraint("choice", '["yes", "no"]')),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, Constraint("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"grammar": 'start: "a"', "grammar_syntax": "lark"}},
     Constraint("grammar", 'start: "a"', grammar_syntax="lark")),
    ({"guided_json": SCHEMA, "disable_any_whitespace": True},
     Constraint("json", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}', True)),
    ({"guided_regex": "x+"}, Constraint("regex", "x+")),
    ({"guided_choice": ["a", "b"]}, Constraint("choice", '["a", "b"]')),
    ({"guided_grammar": 'root ::= "b"'}, Constraint("grammar", 'root ::= "b"')),
    ({"response_format": {"type": "text"}}, None),
    ({}, None),
])
def test_request_fields_map_to_one_constraint(fields, constraint):
    params = from_request(chat(**fields))
    assert (params.constraint() if params else None) == constraint
    kwargs = chat(**fields).sampling_kwargs()
    assert (kwargs["structured_outputs"].constraint() if constraint else kwargs["structured_outputs"]) == constraint


def test_completions_take_the_same_fields():
    req = CompletionRequest(prompt="x", structured_outputs={"choice": ["a"]})
    assert req.sampling_kwargs()["structured_outputs"].choice == ["a"]


@pytest.mark.parametrize("kwargs, field, words", [
    ({}, "structured_outputs", ["exactly one", "none"]),
    ({"json": SCHEMA, "regex": "a"}, "structured_outputs", ["exactly one"]),
    ({"choice": []}, "structured_outputs", ["non-empty"]),
    ({"choice": ["a", 3]}, "structured_outputs", ["strings"]),
    ({"json": "{not json"}, "structured_outputs", ["not valid JSON"]),
    ({"json": '"a string"'}, "structured_outputs", ["must be an object"]),
    ({"json": {"type": "object", "properties": {"a": {"type": "integr"}}}}, "structured_outputs",
     ["invalid at properties/a/type"]),
    ({"json": {"minLength": -1}}, "structured_outputs", ["minLength"]),
    ({"regex": "a" * (MAX_SPEC_BYTES + 1)}, "structured_outputs", [str(MAX_SPEC_BYTES)]),
    ({"grammar": "x", "grammar_syntax": "peg"}, "structured_outputs", ["ebnf", "lark"]),
    ({"regex": 5}, "structured_outputs", ["must be a string"]),
])
def test_bad_constraints_name_the_field(kwargs, field, words):
    with pytest.raises(InvalidParameterError) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.param == field
    for word in words:
        assert word in str(info.value)


def test_sampling_params_carry_and_clone_the_constraint():
    params = SamplingParams(n=2, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    clone = params.clone()
    assert clone.structured_outputs.constraint() == params.structured_outputs.constraint()
    assert clone.structured_outputs is not params.structured_outputs


def test_the_constraint_crosses_the_engine_socket():
    from portaserve.framework.engine.core_messages import AddRequests
    from portaserve.framework.engine.request import Request
    from portaserve.framework.wire import decode, encode

    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"], field_name="guided_choice"))
    msg = decode(encode(AddRequests([Request("r", [1, 2], sampling_params=params)])), AddRequests)
    so = msg.requests[0].sampling_params.structured_outputs
    assert so.constraint() == Constraint("choice", '["a", "b"]') and so.field_name == "guided_choice"
