"""Bounds on every size a request supplies, checked before any work is queued.

A request is parsed by pydantic, then checked here, before its chat template renders,
its prompt is tokenized or anything reaches the engine: going over a limit is a 400
naming the parameter, the limit and the flag that sets it. The request body's own size
is bounded earlier, by `--max-request-body-bytes` (a 413).

Each limit is a `portaserve serve` flag (`--max-n`, ...), listed with its default in
`portaserve serve --help` and in the README's security section.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from portaserve.framework.errors import InvalidParameterError


def _limit(default: int | float, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class RequestLimits:
    """The largest sizes one request may ask for (each one a `portaserve serve` flag)."""

    max_n: int = _limit(128, "most completions (n) one request may ask for")
    max_prompts: int = _limit(256, "most prompts in one /v1/completions request")
    max_sequences: int = _limit(1024, "most sequences one request may start: n x prompts")
    max_stop_strings: int = _limit(64, "most stop strings per request")
    max_stop_string_chars: int = _limit(1024, "longest stop string, in characters")
    max_logit_bias: int = _limit(1024, "most logit_bias entries per request")
    max_stop_token_ids: int = _limit(1024, "most stop_token_ids per request")
    max_tools: int = _limit(128, "most tools per chat request")
    max_tools_bytes: int = _limit(256 * 1024, "largest tools list of a chat request, as JSON bytes")
    max_messages: int = _limit(2048, "most messages in one chat request")
    max_embedding_inputs: int = _limit(2048, "most inputs in one /v1/embeddings request")
    max_token_ids: int = _limit(
        256 * 1024, "longest token-id list in a request (prompts given as ids, /detokenize, allowed_token_ids)")
    max_prompt_logprob_entries: int = _limit(
        1024 * 1024, "most prompt logprobs one request may return: prompt tokens x (prompt_logprobs + 1)")
    max_chat_template_kwargs_bytes: int = _limit(64 * 1024, "largest chat_template_kwargs (or documents), as JSON bytes")
    max_chat_template_bytes: int = _limit(
        64 * 1024, "largest request-supplied chat template (with --trust-request-chat-template)")
    chat_template_timeout: float = _limit(
        5.0, "seconds a request-supplied chat template may render before it is abandoned (with "
        "--trust-request-chat-template)")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise InvalidParameterError(f.name, f"{f.name}: must be > 0, got {value!r}")

    @classmethod
    def flag_help(cls) -> list[tuple[str, str, type, Any]]:
        """(field name, help, type, default) of every limit, for the CLI."""
        return [(f.name, f.metadata["help"], type(f.default), f.default) for f in fields(cls)]

    # ----- the checks --------------------------------------------------------------------------

    def over(self, param: str, value: int | float, name: str, what: str) -> None:
        """Raise a 400 naming `param` when `value` exceeds the limit `name`."""
        limit = getattr(self, name)
        if value > limit:
            flag = "--" + name.replace("_", "-")
            raise InvalidParameterError(param, f"{param}: {what} {value} exceeds the server's limit of {limit} ({flag})")

    def check_sampling(self, req: Any, num_prompts: int = 1) -> None:
        """The sampling fields of chat, completions and the native route (`req` has vLLM's names)."""
        n = getattr(req, "n", 1) or 1
        self.over("n", n, "max_n", "n")
        self.over("n", n * num_prompts, "max_sequences", f"n x prompts ({n} x {num_prompts}) =")
        stop = getattr(req, "stop", None)
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        self.over("stop", len(stops), "max_stop_strings", "the number of stop strings,")
        for s in stops:
            self.over("stop", len(s) if isinstance(s, str) else 0, "max_stop_string_chars", "a stop string's length,")
        self.over("logit_bias", len(getattr(req, "logit_bias", None) or ()), "max_logit_bias", "the number of entries,")
        self.over("stop_token_ids", len(getattr(req, "stop_token_ids", None) or ()), "max_stop_token_ids", "the number of ids,")
        self.over("allowed_token_ids", len(getattr(req, "allowed_token_ids", None) or ()), "max_token_ids",
                  "the number of ids,")

    def check_prompt_logprobs(self, prompt_logprobs: int | None, num_prompt_tokens: int) -> None:
        if prompt_logprobs is not None:
            entries = num_prompt_tokens * (prompt_logprobs + 1)
            self.over("prompt_logprobs", entries, "max_prompt_logprob_entries",
                      f"prompt tokens x (prompt_logprobs + 1) ({num_prompt_tokens} x {prompt_logprobs + 1}) =")

    def check_token_ids(self, param: str, ids: Sequence[Any]) -> None:
        self.over(param, len(ids), "max_token_ids", "the number of token ids,")

    def check_prompts(self, param: str, prompts: Any, limit_name: str) -> int:
        """A `str | list[str] | list[int] | list[list[int]]` prompt field: count, and each id list's length."""
        if isinstance(prompts, str):
            return 1
        items = list(prompts)
        if items and all(isinstance(x, int) for x in items):
            self.check_token_ids(param, items)
            return 1
        self.over(param, len(items), limit_name, "the number of inputs,")
        for item in items:
            if isinstance(item, list):
                self.check_token_ids(param, item)
        return len(items)

    def check_chat(self, req: Any) -> None:
        """messages, tools, chat_template_kwargs / documents and a request's own chat template."""
        self.over("messages", len(req.messages or ()), "max_messages", "the number of messages,")
        if getattr(req, "tools", None):
            self.over("tools", len(req.tools), "max_tools", "the number of tools,")
            self.over("tools", _json_size(t.model_dump(exclude_none=True) for t in req.tools), "max_tools_bytes",
                      "the tools' JSON size (bytes)")
        for name in ("chat_template_kwargs", "documents"):
            value = getattr(req, name, None)
            if value:
                self.over(name, _json_size([value]), "max_chat_template_kwargs_bytes", "the JSON size (bytes)")
        template = getattr(req, "chat_template", None)
        if template is not None:
            self.over("chat_template", len(template.encode("utf-8", "replace")), "max_chat_template_bytes",
                      "the template's size (bytes)")

    def check_truncate(self, truncate_prompt_tokens: int | None, max_model_len: int) -> None:
        if truncate_prompt_tokens is not None and truncate_prompt_tokens > max_model_len:
            raise InvalidParameterError(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens: {truncate_prompt_tokens} exceeds max_model_len ({max_model_len})",
            )


def _json_size(items: Iterable[Any]) -> int:
    total = 0
    for item in items:
        try:
            total += len(json.dumps(item, separators=(",", ":"), default=str))
        except (TypeError, ValueError):
            raise InvalidParameterError("request", "request: a field is not JSON-serializable") from None
    return total
