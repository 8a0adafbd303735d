"""The engine's record of one request (one sequence): what the scheduler and block
manager track. Pure Python, no tensors.

A request with `n > 1` is fanned out by the front end into n of these (child ids
"<parent>-<i>"); they share the prompt's KV blocks through the prefix cache.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from portaserve.framework.lora.request import LoRARequest
from portaserve.framework.multimodal.inputs import MultiModalFeature

from .params import PoolingParams, SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, its KV freed; recomputed when rescheduled
    FINISHED_STOPPED = 3  # EOS, a stop token or a stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # this request alone failed in the engine (a raising logits processor, NaN logits)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """Mutable state of one sequence inside the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None = None
    pooling_params: PoolingParams | None = None
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first under priority scheduling (vLLM's convention)
    cache_salt: str | None = None  # mixed into block hashes: no sharing across salts
    max_tokens: int = 16  # resolved by the engine (SamplingParams.max_tokens or max_model_len - prompt)
    # the prompt's images, their placeholders already expanded in prompt_token_ids
    mm_features: tuple[MultiModalFeature, ...] = ()
    # structured outputs: the engine core's GrammarState (compile, then matcher); set there
    grammar: Any = None
    # the LoRA adapter it runs with (framework/lora), None for the base model
    lora_request: LoRARequest | None = None
    # speculative decoding: proposals to make next step (speculative.py adapts it)
    spec_k: int | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit when first scheduled (for usage / metrics)
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    first_scheduled_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
