"""Forced tool calls, enforced while sampling (structured outputs).

With a `--tool-call-parser` that declares its `call_format` (hermes, llama3_json), the
output is constrained to calls in that format: for `"required"` 1 to MAX_PARALLEL_CALLS
calls of any tool (one without `parallel_tool_calls`), for a named function one call of
it, each `{"name": ..., <arguments key>: <the tool's parameters schema>}`; the parser
reads them back as usual. Without one, vLLM's JSON:

- `tool_choice: "required"`: a JSON list of calls, each
  `{"name": <one of the tools>, "parameters": <that tool's parameters schema>}`;
- a named function: that function's arguments, an object following its parameters schema.

Either way the model cannot produce anything that does not parse into valid calls.
"""

from __future__ import annotations

import json
from typing import Any

from portaserve.framework.server.parsers import ToolCall
from portaserve.framework.structured.params import StructuredOutputsParams

_ANY_OBJECT = {"type": "object"}


def _parameters(tool: Any) -> dict:
    return tool.function.parameters or _ANY_OBJECT


def required_calls_schema(tools: list[Any], parallel: bool) -> dict:
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)}} for t in tools]
    schema: dict = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


#: most calls a forced "required" choice may write (with parallel_tool_calls)
MAX_PARALLEL_CALLS = 4


def tool_constraint(tools: list[Any], choice: Any, parallel: bool, compact: bool = False,
                    call_format: dict | None = None) -> StructuredOutputsParams:
    """The constraint of a forced tool choice ("required" or a named function): calls in
    the tool parser's format where it declares one (`ToolParser.call_format`), which the
    parser then reads back; else vLLM's JSON (parsed by `calls_from_output`)."""
    if call_format is not None:
        key = call_format["arguments_key"]
        chosen = tools if choice == "required" else [t for t in tools if t.function.name == choice.function.name]
        schemas = [{"type": "object", "additionalProperties": False, "required": ["name", key],
                    "properties": {"name": {"const": t.function.name}, key: _parameters(t)}} for t in chosen]
        spec = {"prefix": call_format["prefix"], "suffix": call_format["suffix"], "separator": call_format["separator"],
                "schemas": schemas, "max_calls": MAX_PARALLEL_CALLS if choice == "required" and parallel else 1}
        return StructuredOutputsParams(tool_calls=spec, disable_any_whitespace=compact, field_name="tool_choice")
    if choice == "required":
        schema = required_calls_schema(tools, parallel)
    else:
        schema = _parameters(next(t for t in tools if t.function.name == choice.function.name))
    return StructuredOutputsParams(json=schema, disable_any_whitespace=compact, field_name="tool_choice")


def calls_from_output(text: str, choice: Any) -> list[ToolCall]:
    """The calls a constrained output holds (an unfinished output, cut by max_tokens, holds none)."""
    try:
        data = json.loads(text)
    except ValueError:
        return []
    if choice == "required":
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in data
                if isinstance(c, dict) and "name" in c]
    return [ToolCall(choice.function.name, json.dumps(data, ensure_ascii=False))]
