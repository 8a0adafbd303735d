"""Reasoning and tool-call parsers for chat outputs.

Each parser exists in two forms that must agree: `extract(text)` for a whole output
(non-streaming responses) and `feed(delta)` ... `finish()` for a stream of text deltas.
The streaming form only ever holds back what it cannot decide yet (a partial tag, a
whitespace run, an unfinished tool call), so the concatenated stream equals `extract`
whatever way the text was split. Parsers are found by name through the plugin registry
(`portaserve_reasoning_parsers`, `portaserve_tool_parsers`); see `registry`.
"""

from .base import ReasoningDelta, ReasoningParser, ToolCall, ToolDelta, ToolParser
from .registry import get_reasoning_parser, get_tool_parser, reasoning_parser_names, tool_parser_names

__all__ = [
    "ReasoningDelta",
    "ReasoningParser",
    "ToolCall",
    "ToolDelta",
    "ToolParser",
    "get_reasoning_parser",
    "get_tool_parser",
    "reasoning_parser_names",
    "tool_parser_names",
]
