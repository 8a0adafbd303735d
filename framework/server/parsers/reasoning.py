"""`<think>...</think>` reasoning parsers: `deepseek_r1` and `qwen3`.

Both return the text between the markers, stripped, as `reasoning_content`, and the
text after `</think>`, without its leading whitespace, as `content`. They differ in
when an output is reasoning at all:

- `deepseek_r1`: always: DeepSeek-R1's template opens the block in the prompt, so the
  output starts inside it (a leading `<think>` the model writes anyway is dropped). An
  output that never closes the block is all reasoning.
- `qwen3`: when the output starts with `<think>` (after whitespace), or the rendered
  prompt ends with an open `<think>` (thinking templates that pre-open the block).
  Otherwise the whole output is content, verbatim: e.g. with `enable_thinking=false`
  the template writes an empty block into the prompt. A `</think>` later in an output
  that did not start in reasoning stays content (deciding otherwise would need the whole
  output before streaming anything).
"""

from __future__ import annotations

from .base import LeadingSpaceDropper, ReasoningDelta, ReasoningParser, TrailingSpaceHolder, partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkReasoningParser(ReasoningParser):
    """The shared machinery; subclasses say whether an output without `<think>` is reasoning."""

    start_token = THINK_START
    end_token = THINK_END

    def __init__(self, tokenizer=None, *, prompt: str | None = None) -> None:
        super().__init__(tokenizer, prompt=prompt)
        self._state = "start"  # start | reasoning | content | verbatim
        self._buf = ""
        self._reasoning = TrailingSpaceHolder()
        self._reasoning_lead = LeadingSpaceDropper()
        self._content_lead = LeadingSpaceDropper()

    def starts_in_reasoning(self) -> bool:
        """Whether an output that does not open with `<think>` is reasoning from its start."""
        return self.prompt.rstrip().endswith(self.start_token)

    # ----- whole outputs -------------------------------------------------------------------

    def extract(self, text: str) -> tuple[str | None, str | None]:
        stripped = text.lstrip()
        if stripped.startswith(self.start_token):
            body = stripped[len(self.start_token):]
        elif self.starts_in_reasoning():
            body = text
        else:
            return None, text or None
        reasoning, sep, content = body.partition(self.end_token)
        reasoning = reasoning.strip() or None
        if not sep:
            return reasoning, None
        return reasoning, content.lstrip() or None

    # ----- streams -------------------------------------------------------------------------

    def feed(self, delta: str) -> ReasoningDelta:
        if self._state == "verbatim":
            return ReasoningDelta(content=delta)
        if self._state == "content":
            return ReasoningDelta(content=self._content_lead.push(delta))
        self._buf += delta
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(self.start_token):
                self._buf = head[len(self.start_token):]
            elif self.start_token.startswith(head):
                return ReasoningDelta()  # still maybe "<think>": wait
            elif not self.starts_in_reasoning():
                self._state = "verbatim"
                out, self._buf = self._buf, ""
                return ReasoningDelta(content=out)
            self._state = "reasoning"
        return self._scan_reasoning()

    def _scan_reasoning(self) -> ReasoningDelta:
        at = self._buf.find(self.end_token)
        if at >= 0:
            reasoning = self._emit_reasoning(self._buf[:at]) + self._reasoning.finish(drop=True)
            rest = self._buf[at + len(self.end_token):]
            self._buf = ""
            self._state = "content"
            return ReasoningDelta(reasoning=reasoning, content=self._content_lead.push(rest))
        keep = partial_suffix(self._buf, self.end_token)
        ready = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return ReasoningDelta(reasoning=self._emit_reasoning(ready))

    def _emit_reasoning(self, text: str) -> str:
        return self._reasoning.push(self._reasoning_lead.push(text))

    def finish(self) -> ReasoningDelta:
        buf, self._buf = self._buf, ""
        if self._state == "start":
            if not self.starts_in_reasoning():
                self._state = "verbatim"
                return ReasoningDelta(content=buf)
            self._state = "reasoning"
        if self._state == "reasoning":
            self._state = "content"
            return ReasoningDelta(reasoning=self._emit_reasoning(buf) + self._reasoning.finish(drop=True))
        return ReasoningDelta()


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1: the output starts inside the reasoning block."""

    name = "deepseek_r1"

    def starts_in_reasoning(self) -> bool:
        return True


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3: reasoning only when the output (or the end of the prompt) opens `<think>`."""

    name = "qwen3"
