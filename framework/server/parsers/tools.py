"""Tool-call parsers: `hermes` (`<tool_call>{json}</tool_call>` blocks) and `llama3_json`.

A tool call is emitted whole, once its text is complete (the closing tag, or the end of
the output), never as partial arguments: a client cannot run half a call, and this way
the streamed calls are exactly the non-streamed ones even when the model writes a
malformed call (which then stays in the content, verbatim, in both modes).

Content is the text outside the calls; when there are calls, its trailing whitespace
is dropped (the newlines between and after blocks), and an empty content is None.
"""

from __future__ import annotations

import json
from typing import Any

from .base import ToolCall, ToolDelta, ToolParser, TrailingSpaceHolder, partial_suffix


def _arguments_text(args: Any) -> str | None:
    """Arguments as the JSON text OpenAI's `function.arguments` carries."""
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        return args
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    return None


def call_from_object(obj: Any, *argument_keys: str) -> ToolCall | None:
    """A ToolCall from a parsed `{"name": ..., "<argument_key>": {...}}`, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in argument_keys:
        if key in obj:
            args = _arguments_text(obj[key])
            return None if args is None else ToolCall(obj["name"], args)
    return ToolCall(obj["name"], "{}")


class HermesToolParser(ToolParser):
    """Hermes / Qwen format: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""

    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    call_format = {"prefix": "<tool_call>\n", "suffix": "\n</tool_call>", "separator": "\n", "arguments_key": "arguments"}

    def __init__(self, tokenizer=None, *, tools=None) -> None:
        super().__init__(tokenizer, tools=tools)
        self._in_call = False
        self._buf = ""
        self._content = TrailingSpaceHolder()
        self._num_calls = 0

    def parse_body(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        return call_from_object(obj, "arguments", "parameters")

    # ----- whole outputs -------------------------------------------------------------------

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls: list[ToolCall] = []
        outside: list[str] = []
        pos = 0
        while True:
            start = text.find(self.start_tag, pos)
            if start < 0:
                outside.append(text[pos:])
                break
            outside.append(text[pos:start])
            body_at = start + len(self.start_tag)
            end = text.find(self.end_tag, body_at)
            stop = len(text) if end < 0 else end + len(self.end_tag)
            call = self.parse_body(text[body_at: len(text) if end < 0 else end])
            if call is None:
                outside.append(text[start:stop])
            else:
                calls.append(call)
            pos = stop
            if end < 0:
                break
        content = "".join(outside)
        if calls:
            content = content.rstrip()
        return content or None, calls

    # ----- streams -------------------------------------------------------------------------

    def feed(self, delta: str) -> ToolDelta:
        self._buf += delta
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._in_call:
                at = self._buf.find(self.start_tag)
                if at < 0:
                    keep = partial_suffix(self._buf, self.start_tag)
                    content.append(self._content.push(self._buf[: len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._content.push(self._buf[:at]))
                self._buf = self._buf[at + len(self.start_tag):]
                self._in_call = True
            else:
                at = self._buf.find(self.end_tag)
                if at < 0:
                    break  # the call is not complete yet
                self._close_call(self._buf[:at], self.end_tag, content, calls)
                self._buf = self._buf[at + len(self.end_tag):]
        return ToolDelta("".join(content), tuple(calls))

    def _close_call(self, body: str, closing: str, content: list[str], calls: list[ToolCall]) -> None:
        self._in_call = False
        call = self.parse_body(body)
        if call is None:
            content.append(self._content.push(self.start_tag + body + closing))
        else:
            calls.append(call)
            self._num_calls += 1

    def finish(self) -> ToolDelta:
        content: list[str] = []
        calls: list[ToolCall] = []
        buf, self._buf = self._buf, ""
        if self._in_call:
            self._close_call(buf, "", content, calls)
        else:
            content.append(self._content.push(buf))
        content.append(self._content.finish(drop=self._num_calls > 0))
        return ToolDelta("".join(content), tuple(calls))


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}`,
    optionally after `<|python_tag|>`, several calls separated by `;`.

    An answer that does not start with `{` (after whitespace and the tag) is content, and
    streams as such; one that does is held until the end, then parsed; if it is not valid
    calls it is returned as content, verbatim.
    """

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    call_format = {"prefix": "", "suffix": "", "separator": "; ", "arguments_key": "parameters"}

    def __init__(self, tokenizer=None, *, tools=None) -> None:
        super().__init__(tokenizer, tools=tools)
        self._state = "start"  # start | content | json
        self._buf = ""

    def _json_part(self, text: str) -> str | None:
        """The text after the optional tag when it starts with `{`, else None."""
        head = text.lstrip()
        if head.startswith(self.python_tag):
            head = head[len(self.python_tag):].lstrip()
        return head if head.startswith("{") else None

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos, n = 0, len(text)
        while True:
            while pos < n and text[pos].isspace():
                pos += 1
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            call = call_from_object(obj, "parameters", "arguments")
            if call is None:
                return None
            calls.append(call)
            while pos < n and text[pos].isspace():
                pos += 1
            if pos == n:
                return calls
            if text[pos] != ";":
                return None
            pos += 1

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = self._json_part(text)
        calls = self.parse_calls(body) if body is not None else None
        if not calls:
            return text or None, []
        return None, calls

    def feed(self, delta: str) -> ToolDelta:
        if self._state == "content":
            return ToolDelta(delta)
        self._buf += delta
        if self._state == "json":
            return ToolDelta()
        head = self._buf.lstrip()
        if head.startswith(self.python_tag):
            rest = head[len(self.python_tag):].lstrip()
            if not rest:
                return ToolDelta()
            decided_json = rest.startswith("{")
        elif self.python_tag.startswith(head):
            return ToolDelta()  # empty so far, or maybe the tag
        else:
            decided_json = head.startswith("{")
        if decided_json:
            self._state = "json"
            return ToolDelta()
        self._state = "content"
        out, self._buf = self._buf, ""
        return ToolDelta(out)

    def finish(self) -> ToolDelta:
        buf, self._buf = self._buf, ""
        if self._state == "json":
            content, calls = self.extract(buf)
            return ToolDelta(content or "", tuple(calls))
        return ToolDelta(buf)
