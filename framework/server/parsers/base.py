"""The parser interfaces and the small text-stream helpers the built-in parsers share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """What one piece of streamed text adds to the reasoning and to the answer."""

    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One complete function call: its name and its arguments as a JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolDelta:
    """What one piece of streamed text adds: answer text and completed tool calls."""

    content: str = ""
    tool_calls: tuple[ToolCall, ...] = field(default_factory=tuple)


class ReasoningParser(ABC):
    """Splits a model's output into its reasoning and its answer; one instance per completion."""

    #: The name given to ``--reasoning-parser``.
    name: ClassVar[str] = ""

    def __init__(self, tokenizer: Any | None = None, *, prompt: str | None = None) -> None:
        """:param tokenizer: the model's tokenizer (unused by the text-based built-ins).
        :param prompt: the rendered prompt text; a template may open the reasoning block itself."""
        self.tokenizer = tokenizer
        self.prompt = prompt or ""

    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where a part is empty."""

    @abstractmethod
    def feed(self, delta: str) -> ReasoningDelta:
        """Consume the next piece of streamed text; return what can be emitted now."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """The stream ended: return everything still held back."""


class ToolParser(ABC):
    """Finds tool calls in a model's answer text; one instance per completion."""

    #: The name given to ``--tool-call-parser``.
    name: ClassVar[str] = ""

    #: how calls are written, for forcing them while sampling (tool_choice "required" or a
    #: named function): {"prefix", "suffix", "separator", "arguments_key"}; None: the server
    #: falls back to vLLM's JSON list of {"name", "parameters"}
    call_format: ClassVar[dict | None] = None

    def __init__(self, tokenizer: Any | None = None, *, tools: Sequence[Any] | None = None) -> None:
        """:param tokenizer: the model's tokenizer. :param tools: the request's tools."""
        self.tokenizer = tokenizer
        self.tools = list(tools or [])

    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole answer; content None when empty."""

    @abstractmethod
    def feed(self, delta: str) -> ToolDelta:
        """Consume the next piece of streamed answer text; return what can be emitted now."""

    @abstractmethod
    def finish(self) -> ToolDelta:
        """The stream ended: return everything still held back."""


# ----- helpers -------------------------------------------------------------------------------


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (0 if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class TrailingSpaceHolder:
    """Emits text but keeps its trailing whitespace until more text shows it is not trailing.

    Lets a stream produce `"".join(parts).rstrip()` (when `finish(drop=True)`) without
    knowing in advance where the text ends.
    """

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = ""

    def push(self, text: str) -> str:
        if not text:
            return ""
        body = text.rstrip()
        if not body:  # whitespace only: all of it may still be trailing
            self.held += text
            return ""
        out = self.held + body
        self.held = text[len(body):]
        return out

    def finish(self, drop: bool) -> str:
        out = "" if drop else self.held
        self.held = ""
        return out


class LeadingSpaceDropper:
    """Drops whitespace at the start of a text stream (`str.lstrip` over the whole stream)."""

    __slots__ = ("started",)

    def __init__(self) -> None:
        self.started = False

    def push(self, text: str) -> str:
        if self.started or not text:
            return text
        text = text.lstrip()
        if text:
            self.started = True
        return text
