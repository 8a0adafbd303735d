"""Forced tool calls, enforced while sampling (structured outputs), the way vLLM does it.

- `tool_choice: "required"`: the output is a JSON list of calls, each
  `{"name": <one of the tools>, "parameters": <that tool's parameters schema>}` (one
  call when `parallel_tool_calls` is false);
- a named function: the output is that function's arguments, an object following its
  parameters schema.

Either way the model cannot produce anything that does not parse into valid calls, so
no tool-call parser is needed; the server turns the JSON into `tool_calls`.
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


def tool_constraint(tools: list[Any], choice: Any, parallel: bool, compact: bool = False) -> StructuredOutputsParams:
    """The constraint of a forced tool choice ("required" or a named function)."""
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
