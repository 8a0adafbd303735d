"""Request parameters: `SamplingParams` (generation) and `PoolingParams` (embeddings).

Names, defaults and meanings follow vLLM's so users can switch. Validation happens on
construction and names the parameter and the allowed range; checks that need the
model (max_model_len, vocabulary size) happen in `validate_for_model`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from portaserve.framework.errors import InvalidParameterError, invalid
from portaserve.framework.structured.params import StructuredOutputsParams

# A logits processor sees (output token ids so far, logits row [vocab]) and returns the
# row to sample from; used by tests to force an output (not exposed over HTTP).
LogitsProcessor = Callable[[list[int], Any], Any]


class RequestOutputKind(Enum):
    """What each streamed RequestOutput carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes


#: Beyond these a sampling parameter only means "uniform" (temperature) or overflows float32
#: (the repetition penalty divides positive logits: 2e-152, found by the fuzzer, made them inf).
MAX_TEMPERATURE = 1e4
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 1e4

@dataclass
class SamplingParams:
    """How to sample one request's completion(s)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, accepted for vLLM compatibility) disables
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs besides the sampled token's
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    #: a JSON schema, regex, choice or grammar the output must follow (structured outputs)
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    logits_processors: list[LogitsProcessor] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: stop_token_ids plus the model's EOS ids (filled by the engine from generation_config).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise invalid("logit_bias", "keys must be token ids and values numbers") from None
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        def check(cond: bool, param: str, msg: str) -> None:
            if not cond:
                raise invalid(param, msg)

        check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        # upper bounds too: float32 logits divided by a temperature past ~1e38 (inf) became NaN
        check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
              f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        check(0.0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
              f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", f"must be 0 or -1 (disabled) or >= 1, got {self.top_k!r}")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            check(isinstance(self.logprobs, int) and self.logprobs >= 0, "logprobs", f"must be an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None:
            check(isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0, "prompt_logprobs", f"must be an integer >= 0, got {self.prompt_logprobs!r}")
        if self.seed is not None:
            check(isinstance(self.seed, int) and -(2**63) <= self.seed < 2**64, "seed",
                  f"must be an integer in [-2^63, 2^64), got {self.seed!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids >= 0")
        if self.logit_bias:
            check(all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()), "logit_bias", "values must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            check(len(self.allowed_token_ids) > 0, "allowed_token_ids", "must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate_for_model(self, prompt_len: int, max_model_len: int, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model; raises InvalidParameterError naming the limit."""
        if prompt_len + (self.max_tokens or 1) > max_model_len:
            if self.max_tokens is None or prompt_len >= max_model_len:
                raise InvalidParameterError(
                    "prompt",
                    f"prompt: the prompt has {prompt_len} tokens, but max_model_len is {max_model_len} "
                    f"(prompt + max_tokens must be <= max_model_len)",
                )
            raise InvalidParameterError(
                "max_tokens",
                f"max_tokens: {self.max_tokens} is too large: the prompt has {prompt_len} tokens and "
                f"max_model_len is {max_model_len}, so at most {max_model_len - prompt_len} tokens can be generated",
            )
        for param, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None and value > max_logprobs:
                raise invalid(param, f"must be <= {max_logprobs} (the server's max_logprobs), got {value}")
        for param, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", (self.logit_bias or {}).keys()),
            ("allowed_token_ids", self.allowed_token_ids or ()),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise invalid(param, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")

    def clone(self) -> "SamplingParams":
        # logits processors may hold state the caller wants shared; copy the rest
        procs = self.logits_processors
        self.logits_processors = None
        try:
            out = copy.deepcopy(self)
        finally:
            self.logits_processors = procs
        out.logits_processors = procs
        return out


@dataclass
class PoolingParams:
    """How to turn an encoder's hidden states into an embedding."""

    normalize: bool | None = None  # None: what the model folder declares
    dimensions: int | None = None  # truncate (matryoshka) to this many dimensions

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise invalid("dimensions", f"must be an integer >= 1, got {self.dimensions!r}")
