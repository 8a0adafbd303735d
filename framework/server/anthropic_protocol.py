"""The Anthropic Messages API's request shapes (`POST /v1/messages`, `/v1/messages/count_tokens`).

Content blocks stay plain dicts (validated where they are translated, messages_translate.py),
so one unknown block type is a 400 that names it rather than a wall of union errors.
Fields the API has but that change nothing here (`metadata`, `cache_control` on any
block, `service_tier`) are accepted and ignored; ones that would change the output and
cannot be honoured (`mcp_servers`, `container`, server tools) are refused.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from portaserve.framework.server.protocol import OpenAIBaseModel


class AnthropicTool(OpenAIBaseModel):
    """A client tool: `name`, `description`, `input_schema`. Server tools carry a `type`
    (`web_search_20250305`, `bash_20250124`, ...) and are refused."""

    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class AnthropicToolChoice(OpenAIBaseModel):
    type: str  # auto | any | tool | none
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicThinking(OpenAIBaseModel):
    type: str  # enabled | disabled | adaptive
    budget_tokens: int | None = None


class AnthropicOutputConfig(OpenAIBaseModel):
    """`effort` (the template's reasoning effort) and `format` (`{"type": "json_schema", "schema"}`)."""

    effort: str | None = None
    format: dict[str, Any] | None = None


class AnthropicMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]]


class CountTokensRequest(OpenAIBaseModel):
    """`/v1/messages/count_tokens`: the conversation as it would be sent."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    output_config: AnthropicOutputConfig | None = None
    # ignored, as the API allows
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # refused when set (messages_translate.py)
    mcp_servers: list[Any] | None = None
    container: Any = None


class MessagesRequest(CountTokensRequest):
    """`/v1/messages`: the conversation plus sampling. `max_tokens` is required, as in the API."""

    #: 0 only renders and caches the prompt (the API's cache pre-warming): nothing is generated
    max_tokens: int = Field(ge=0)
    stop_sequences: list[str] | None = None
    # older clients send these; current ones through extra_body
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    disable_any_whitespace: bool = False  # vLLM's: constrained JSON (tool calls, formats) without free whitespace
    stream: bool = False
