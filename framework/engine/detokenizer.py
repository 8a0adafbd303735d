"""Incremental detokenization and stop strings, per request.

`IncrementalDetokenizer` turns one token id at a time into the text it completes. A
token may end in the middle of a UTF-8 character (byte-level BPE splits CJK characters
and emoji across tokens), so the new text is held back while the decoded tail ends in
U+FFFD, and released once the character is complete. Each step decodes only a short
window: the tokens from a "prefix" offset (a few tokens of context, so decoders that
treat the first token specially, like SentencePiece's leading space, see it in the
middle of a text) to the end, and returns what the window's text has beyond the text of
the tokens already read. The concatenated deltas, plus `flush()` at the end, equal
`tokenizer.decode(all_ids)` exactly.

`skip_special_tokens` drops special ids before decoding (what `decode` does).
`spaces_between_special_tokens` is accepted for vLLM compatibility and changes nothing:
portaserve loads tokenizer.json tokenizers only, whose decoder joins added tokens to
their neighbours, as vLLM does with such (fast) tokenizers.

`StopChecker` matches stop strings in the generated text across token boundaries, with
vLLM's semantics:

- the text ends just before the stop string, or just after it with
  `include_stop_str_in_output`; the token ids keep every generated token;
- streamed text never shows a piece that later turns out to begin a stop string: the
  longest tail of the text that is a proper prefix of a stop string is held back until
  the next tokens settle it (nothing is held with `include_stop_str_in_output`, since
  the stop string is output anyway);
- `min_tokens`: as in vLLM (PR 22014), text produced by the first `min_tokens` tokens is
  not searched, so a stop string only matches if it ends in the text of a later token (it
  may start earlier). Stop token ids and EOS are the sampler's business (it masks them
  below min_tokens);
- when several stop strings match in the same step, the one that ends first wins (the
  longest of those on a tie) — where generation would have stopped had the text come one
  character at a time. vLLM takes the first in list order instead.

`RequestDetokenizer` puts the two together for one completion, with vLLM's
`update(new_token_ids, stop_terminated)` / `get_next_output_text(finished, delta)`
interface: a stop token id (EOS or `stop_token_ids`) ends the request and, unless
`include_stop_str_in_output`, its text is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from portaserve.framework.errors import invalid

#: Prompt tokens decoded as context before the first generated token (vLLM's value).
INITIAL_CONTEXT_TOKENS = 5
# Once the window holds this many tokens, it restarts at the last read offset.
_MAX_WINDOW_TOKENS = 8
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Token ids in, new text out, never half a character."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        """:param tokenizer: a `portaserve.framework.engine.tokenizer.Tokenizer` (anything with
            `decode(ids, skip_special_tokens)` and `special_ids`).
        :param prompt_token_ids: the prompt; its last few tokens are context for the first
            generated ones (a leading-space decoder then gives " word", not "word").
        """
        self._decode = tokenizer.decode
        self._skip: frozenset[int] = frozenset(tokenizer.special_ids) if skip_special_tokens else frozenset()
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._ids: list[int] = []  # the window: the last ids, specials removed when skipped
        self._read = 0  # the text of ids[:_read] has been returned
        self._prefix_text = ""  # decode(ids[:_read])
        if prompt_token_ids:
            self._prime([i for i in prompt_token_ids[-INITIAL_CONTEXT_TOKENS:] if i not in self._skip])

    def _prime(self, context: list[int]) -> None:
        # Read up to the last clean boundary of the context: a prompt that ends inside a
        # character leaves its tail pending, and the first output completes the character.
        for end in range(len(context), -1, -1):
            text = self._decode(context[:end], skip_special_tokens=False)
            if not text.endswith(_REPLACEMENT):
                break
        self._ids = context
        self._read = end
        self._prefix_text = text

    def add(self, token_id: int) -> str:
        """Feed one token id; returns the text it completes ("" while a character is incomplete)."""
        if token_id in self._skip:
            return ""
        ids = self._ids
        ids.append(token_id)
        text = self._decode(ids, skip_special_tokens=False)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        delta = text[len(self._prefix_text) :]
        if len(ids) > _MAX_WINDOW_TOKENS:
            # Restart the window at the previous read offset (a clean character boundary).
            del ids[: self._read]
            self._prefix_text = self._decode(ids, skip_special_tokens=False)
        else:
            self._prefix_text = text
        self._read = len(ids)
        return delta

    def flush(self) -> str:
        """The held-back tail (an incomplete character decodes to U+FFFD); call once at the end."""
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids, skip_special_tokens=False)
        delta = text[len(self._prefix_text) :]
        self._prefix_text = text
        self._read = len(self._ids)
        return delta


class StopChecker:
    """Stop strings over a growing text (see the module docstring for the semantics)."""

    def __init__(self, stop: Sequence[str] | None, *, include_stop_str_in_output: bool = False, min_tokens: int = 0) -> None:
        self.stop: tuple[str, ...] = tuple(s for s in (stop or ()) if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.text = ""
        self.num_tokens = 0
        #: The stop string that ended the text, once one has.
        self.matched: str | None = None
        self._released = 0
        # A held-back tail ends with one of these characters (any but a stop string's last).
        self._inner_chars = frozenset("".join(s[:-1] for s in self.stop))

    def add(self, text: str) -> str | None:
        """Append the text of one more generated token; returns the stop string it completes, if any.

        After a match the text is truncated and later calls change nothing.
        """
        if self.matched is not None:
            return None
        self.num_tokens += 1
        start = len(self.text)
        self.text += text
        if not text or not self.stop or self.num_tokens <= self.min_tokens:
            return None
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for s in self.stop:
            at = self.text.find(s, max(0, start - len(s) + 1))
            if at >= 0:
                key = (at + len(s), -len(s), s)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, neg_len, s = best
        self.text = self.text[:end] if self.include_stop_str_in_output else self.text[: end + neg_len]
        self.matched = s
        return s

    def append_unchecked(self, text: str) -> None:
        """Append text that is not searched (the detokenizer's flushed tail at the end)."""
        if self.matched is None:
            self.text += text

    def _held_back(self) -> int:
        # The longest tail of the text that is a proper prefix of some stop string.
        text = self.text
        longest = 0
        if not text or text[-1] not in self._inner_chars:
            return 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def releasable(self, finished: bool = False) -> int:
        """How much of the text may be shown now; never less than before."""
        if finished or self.matched is not None or self.include_stop_str_in_output or not self.stop:
            upto = len(self.text)
        else:
            upto = len(self.text) - self._held_back()
        self._released = max(self._released, upto)
        return self._released


class RequestDetokenizer:
    """The text of one completion: detokenization, stop strings and what to stream."""

    def __init__(self, tokenizer: Any | None, params: Any, prompt_token_ids: Sequence[int] = ()) -> None:
        """:param tokenizer: the engine's Tokenizer, or None when started without one (no text).
        :param params: the request's SamplingParams (stop, include_stop_str_in_output,
            min_tokens, skip_special_tokens, spaces_between_special_tokens, detokenize).
        """
        stop = list(params.stop or ())
        self._detok: IncrementalDetokenizer | None = None
        if tokenizer is not None and params.detokenize:
            self._detok = IncrementalDetokenizer(
                tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                prompt_token_ids=prompt_token_ids,
            )
        elif stop:
            raise invalid("stop", "stop strings need the output detokenized (a tokenizer and detokenize=True)")
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self._stops = StopChecker(stop, include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)
        self.token_ids: list[int] = []
        self._flushed = False
        self._last_offset = 0

    @property
    def output_text(self) -> str:
        """All text so far (including what streaming still holds back), truncated at a stop string."""
        return self._stops.text

    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Take a step's new token ids; returns the stop string that matched, if any (the request is then done).

        :param stop_terminated: the last id is a stop token (EOS or stop_token_ids); its
            text is left out unless include_stop_str_in_output.
        """
        if not new_token_ids:
            return None
        ids = list(new_token_ids)
        silent = ids.pop() if stop_terminated and not self.include_stop_str_in_output else None
        matched = None
        #: of this call's ids, how many precede the stop string's end (several ids arrive at
        #: once with speculative decoding: the ones after the match are not output)
        self.stop_cut = None
        for i, token_id in enumerate(ids):
            if self._stops.matched is not None:
                break
            self.token_ids.append(token_id)
            text = self._detok.add(token_id) if self._detok is not None else ""
            matched = self._stops.add(text) or matched
            if matched is not None:
                self.stop_cut = i + 1
                return matched
        if silent is not None:
            self.token_ids.append(silent)
        return matched

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: all of it (`delta=False`) or what is new since the last call.

        While unfinished, a possible beginning of a stop string is held back; `finished`
        releases everything, including a last incomplete character.
        """
        if finished and not self._flushed:
            self._flushed = True
            if self._detok is not None:
                self._stops.append_unchecked(self._detok.flush())
        upto = self._stops.releasable(finished)
        text = self._stops.text
        if not delta:
            return text[:upto]
        out = text[self._last_offset : upto]
        self._last_offset = max(self._last_offset, upto)
        return out
