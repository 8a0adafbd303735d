"""The OpenAI Responses API's request shape (`POST /v1/responses`).

Input items, tools and formats stay plain dicts here and are checked where they are
translated (responses_translate.py), so that an unsupported item or hosted tool is a 400
naming it. Beyond OpenAI's fields, vLLM's sampling extras are accepted (`seed`, `top_k`,
`min_p`, `repetition_penalty`, `stop`, `priority`, `cache_salt`, `request_id`).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from portaserve.framework.errors import invalid
from portaserve.framework.server.protocol import OpenAIBaseModel

#: OpenAI's bounds on `metadata`
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    truncation: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
    # accepted and ignored: they change nothing here
    user: str | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    max_tool_calls: int | None = None
    # vLLM's extras
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    disable_any_whitespace: bool = False

    def unsupported_fields(self) -> None:
        """Raise for the fields that would change the output but cannot be honoured."""
        self.report_ignored()
        if self.background:
            raise invalid("background", "background responses are not supported; use stream or a plain request")
        if self.conversation is not None:
            raise invalid("conversation", "the Conversations API is not supported; use previous_response_id")
        if self.prompt is not None:
            raise invalid("prompt", "stored prompt templates are not supported; send input and instructions")
        if self.truncation not in (None, "disabled"):
            raise invalid("truncation", f"{self.truncation!r} is not supported; allowed: 'disabled'")
        if self.top_logprobs:
            raise invalid("top_logprobs", "logprobs are not supported on /v1/responses; use /v1/chat/completions")
        if self.input is None and self.previous_response_id is None:
            raise invalid("input", "is required (or previous_response_id)")
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_KEYS:
            raise invalid("metadata", f"{len(meta)} keys exceed the limit of {MAX_METADATA_KEYS}")
        for key, value in meta.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise invalid("metadata", f"keys are at most {MAX_METADATA_KEY_CHARS} characters and values at most "
                                          f"{MAX_METADATA_VALUE_CHARS} ({key[:80]!r})")
