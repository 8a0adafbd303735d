"""The HTTP protocol: pydantic request and response models, OpenAI's and vLLM's field names.

Requests accept fields they do not know and ignore them, as vLLM does (clients send
`user`, `metadata`, `store`, ... freely); the ignored names are logged. A field that
would change what the client gets but that portaserve cannot do yet is rejected with a
400 that says so (`unsupported_fields`), never silently ignored: beam search, `best_of` >
`n`, per-request logits processors, audio, `suffix`, the deprecated `functions` /
`function_call`. Structured outputs (`response_format`, `structured_outputs`,
`guided_*`) map onto framework/structured/params.py.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from portaserve.framework.errors import InvalidParameterError, invalid
from portaserve.framework.structured.params import from_request as structured_from_request


logger = logging.getLogger("portaserve.server")
_reported: set[str] = set()


class OpenAIBaseModel(BaseModel):
    """Unknown fields are kept (so they can be listed) and otherwise ignored."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    def ignored_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())

    def report_ignored(self) -> None:
        """Log (once per field name) the unknown fields a request carried."""
        new = [f for f in self.ignored_fields() if f not in _reported]
        if new and len(_reported) < 1000:
            _reported.update(new)
            logger.warning("%s: ignoring unknown field(s) %s", type(self).__name__, ", ".join(new))


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    schema_: Any = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="allow", protected_namespaces=(), populate_by_name=True)


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag", "grammar", "regex"]
    json_schema: JsonSchemaFormat | None = None


# ----- sampling fields shared by chat and completions ------------------------------------------


class SamplingRequest(OpenAIBaseModel):
    """The sampling fields of chat and completions: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling parameters
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    # structured outputs: vLLM's object and its legacy fields (framework/structured/params.py)
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    disable_any_whitespace: bool = False
    # accepted only to be rejected with a clear message (see unsupported_fields)
    logits_processors: Any = None

    def unsupported_fields(self) -> None:
        """Raise for any field that changes the output but is not supported yet."""
        self.report_ignored()
        fmt = self.response_format
        if fmt is not None and fmt.type not in ("text", "json_object", "json_schema"):
            raise invalid("response_format", f"type {fmt.type!r}: supported are 'text', 'json_object' and 'json_schema' "
                                             f"(regex, grammar and structural tags: the structured_outputs field)")
        if self.use_beam_search:
            raise invalid("use_beam_search", "beam search is not supported")
        if self.length_penalty != 1.0:
            raise invalid("length_penalty", "only applies to beam search, which is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of", f"must equal n ({self.n}) or be omitted: choosing the best of several samples is not supported")
        if self.logits_processors is not None:
            raise invalid("logits_processors", "per-request logits processors are not supported; use the server's --logits-processors")
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "is only allowed when stream is true")

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments common to chat and completions (defaults left out)."""
        kw: dict[str, Any] = dict(
            n=self.n,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            prompt_logprobs=self.prompt_logprobs,
            allowed_token_ids=self.allowed_token_ids,
            structured_outputs=structured_from_request(self),
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.logit_bias:
            try:
                kw["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise invalid("logit_bias", "keys must be token ids (integers as strings)") from None
        return kw


# ----- chat completions ------------------------------------------------------------------------


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)  # OpenAI rejects an empty conversation
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    reasoning_effort: str | None = None
    # vLLM's chat extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    documents: list[dict[str, str]] | None = None
    # rejected
    functions: Any = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None

    def unsupported_fields(self) -> None:
        super().unsupported_fields()
        if self.functions is not None or self.function_call is not None:
            raise invalid("functions", "the deprecated functions / function_call are not supported; use tools and tool_choice")
        if self.audio is not None or (self.modalities and any(m != "text" for m in self.modalities)):
            raise invalid("modalities", "only text output is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "requires logprobs to be true")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise invalid("top_logprobs", f"must be >= 0, got {self.top_logprobs}")

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[int, Any] | None] | None = None


# ----- completions -----------------------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    def unsupported_fields(self) -> None:
        super().unsupported_fields()
        if self.suffix:
            raise invalid("suffix", "insertion (suffix) is not supported")
        if self.logprobs is not None and self.logprobs < 0:
            raise invalid("logprobs", f"must be >= 0, got {self.logprobs}")


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Any] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# ----- embeddings --------------------------------------------------------------------------------


class EmbeddingRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = 0
    request_id: str | None = None


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: Usage


# ----- tokenize / detokenize -------------------------------------------------------------------


class TokenizeRequest(OpenAIBaseModel):
    """Either `prompt` (text) or `messages` (rendered with the chat template first)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ----- the native token-in / token-out route ------------------------------------------------------

#: SamplingParams fields the native route accepts in `sampling_params` (vLLM's names).
NATIVE_SAMPLING_FIELDS = frozenset(
    {
        "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
        "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
        "prompt_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
        "include_stop_str_in_output", "logit_bias", "allowed_token_ids",
    }
)


class GenerateRequest(OpenAIBaseModel):
    """`/inference/v1/generate`: token ids and SamplingParams in, token ids (and logprobs) out."""

    request_id: str | None = None
    token_ids: list[int]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0

    def check_sampling_fields(self) -> None:
        unknown = sorted(set(self.sampling_params) - NATIVE_SAMPLING_FIELDS)
        if unknown:
            raise InvalidParameterError(
                "sampling_params",
                f"sampling_params: unknown field(s) {unknown}; allowed: {', '.join(sorted(NATIVE_SAMPLING_FIELDS))}",
            )


class GenerateChoice(BaseModel):
    index: int
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] = Field(default_factory=list)


class GenerateResponse(BaseModel):
    request_id: str
    choices: list[GenerateChoice]
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    usage: Usage | None = None


# ----- models --------------------------------------------------------------------------------------


class ModelCard(BaseModel):
    """A model in OpenAI's shape, with Anthropic's fields too (`type`, `display_name`,
    `created_at`): both clients list and retrieve models from the same route."""

    id: str
    object: Literal["model"] = "model"
    type: Literal["model"] = "model"
    display_name: str | None = None
    created: int = Field(default_factory=lambda: int(time.time()))
    created_at: str | None = None
    owned_by: str = "portaserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    weights_version: int = 0
    demo: bool = False
    description: str | None = None
    #: what prompts may hold: ["text"], or ["text", "image"] for a vision-language model
    input_modalities: list[str] = Field(default_factory=lambda: ["text"])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
    # Anthropic's page fields
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
