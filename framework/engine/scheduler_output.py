"""What crosses the scheduler -> model runner -> scheduler boundary each step.

Frozen, slotted, tensor-free and picklable, so the same objects go to an in-process
runner or to worker processes. The runner keeps its own copy of each running request's
tokens (it appends what it samples), so a step only sends new requests in full and
deltas for the others (vLLM v1's scheme).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from portaserve.framework.lora.request import LoRARequest
from portaserve.framework.multimodal.inputs import MultiModalFeature

from .params import PoolingParams, SamplingParams


#: a proposal the runner's draft model makes (executor/draft_model.py): the scheduler
#: only decides how many, and the worker holds the draft's weights and KV cache
DRAFT_MODEL_SLOT = -1


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    # Tokens generated before a preemption; recomputed with the prompt.
    output_token_ids: tuple[int, ...]
    sampling_params: SamplingParams | None
    pooling_params: PoolingParams | None
    block_ids: tuple[int, ...]
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hit)
    mm_features: tuple[MultiModalFeature, ...] = ()
    lora_request: LoRARequest | None = None


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """A running request's change since the previous step."""

    req_id: str
    new_block_ids: tuple[int, ...]  # appended to its block table
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's work, in batch order: new requests first, then cached ones."""

    new_requests: tuple[NewRequestData, ...]
    cached_requests: tuple[CachedRequestData, ...]
    # req_id -> tokens to compute this step (a prefill chunk, or 1 for a decode)
    num_scheduled_tokens: Mapping[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished, were aborted or preempted since the last step: the runner
    # drops their state (a preempted one comes back later as a NewRequestData).
    finished_req_ids: frozenset[str]
    # images whose encoder outputs the runner computes this step, before the forward,
    # and keeps by hash (the scheduler's EncoderCacheManager decided which)
    scheduled_encoder_inputs: tuple[MultiModalFeature, ...] = ()
    # encoder outputs (by feature hash) the runner drops before computing new ones
    free_encoder_hashes: tuple[str, ...] = ()
    # structured outputs: the requests that sample under a grammar this step, and their
    # allowed-token bitmask rows (int32 [len(ids), ceil(vocab / 32)], as bytes)
    grammar_req_ids: tuple[str, ...] = ()
    grammar_bitmask: Any = b""  # bytes, or a PendingBitmask filled while the model runs
    # rows per request of grammar_req_ids, in order: 1 + its proposals (a row per sampled
    # position) when it speculates, else 1 (an empty tuple: 1 each)
    grammar_rows: tuple[int, ...] = ()
    # speculative decoding: req_id -> proposed tokens, scheduled after its last token;
    # DRAFT_MODEL_SLOT entries are places the runner's draft model fills before the forward
    spec_token_ids: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def req_ids(self) -> list[str]:
        return [r.req_id for r in self.new_requests] + [r.req_id for r in self.cached_requests]


@dataclass(frozen=True, slots=True)
class Logprobs:
    """Logprobs of one position: the sampled (or actual prompt) token, then the top-k."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRunnerOutput:
    """What one step produced, keyed by request id (keyword arguments only; each field
    defaults to empty)."""

    # req_id -> sampled token id, for requests that reached the end of their known tokens
    sampled_token_ids: Mapping[str, int] = field(default_factory=dict)
    # speculative decoding: req_id -> the proposals accepted this step, in order: the
    # request's new tokens are these, then its sampled token (with their logprobs)
    accepted_token_ids: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    accepted_logprobs: Mapping[str, tuple[Logprobs, ...]] = field(default_factory=dict)
    logprobs: Mapping[str, Logprobs] = field(default_factory=dict)
    # req_id -> logprobs of the prompt positions computed this step (position i predicts token i+1)
    prompt_logprobs: Mapping[str, tuple[Logprobs, ...]] = field(default_factory=dict)
    # req_id -> embedding, for pooling requests whose prompt finished this step
    pooler_output: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    # req_id -> why this request alone failed this step (it gets no token and ends with "error")
    errors: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineCoreOutput:
    """What the engine core reports for one request after a step (token deltas); built
    with keywords only (nine fields, most of them optional)."""

    req_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[Logprobs, ...] = ()
    prompt_logprobs: tuple[Logprobs, ...] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    pooler_output: tuple[float, ...] | None = None
    error: str | None = None  # with finish_reason "error": what failed


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot for metrics and tests (counters are cumulative)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks held by requests
    num_free_blocks: int
    num_total_blocks: int  # usable blocks (the null block excluded)
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int
    num_steps: int  # non-empty steps scheduled
    encoder_cache_misses: int = 0  # images encoded
    encoder_cache_hits: int = 0  # image uses served by an encoding already in the cache
    # speculative decoding: steps of a request with proposals, tokens proposed, accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
