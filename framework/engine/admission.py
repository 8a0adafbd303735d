"""Admission and stop checks: whether a request can ever be served by a scheduler's
engine, and whether a sampled token ends it (and appending a step's tokens).

Refused up front, with an error naming the parameter to change, rather than left to
wait forever or to preempt its siblings endlessly: a prompt too long for the model,
a prompt + max_tokens larger than the whole KV cache, an unchunkable prompt over the
step budget, an image larger than what one step encodes, `n` sequences that cannot fit
together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from portaserve.framework.errors import InvalidParameterError, invalid

from .request import Request, RequestStatus
from .scheduler_output import EngineCoreOutput
from .speculative import next_num_drafts

if TYPE_CHECKING:
    from .scheduler import Scheduler


def check_request_fits(scheduler: "Scheduler", request: Request) -> None:
    """:raises InvalidParameterError: if `request` can never be served."""
    num_prompt = request.num_prompt_tokens
    if num_prompt == 0:
        raise invalid("prompt", "must contain at least one token")
    if request.is_pooling:
        if num_prompt > scheduler.max_model_len:
            raise InvalidParameterError(
                "prompt", f"prompt: {num_prompt} tokens exceed max_model_len ({scheduler.max_model_len})"
            )
        needed = num_prompt
    else:
        if num_prompt >= scheduler.max_model_len:
            raise InvalidParameterError(
                "prompt",
                f"prompt: {num_prompt} tokens leave no room to generate within max_model_len ({scheduler.max_model_len})",
            )
        needed = min(num_prompt + request.max_tokens, scheduler.max_model_len)
    capacity = scheduler.block_manager.capacity_tokens()
    if needed > capacity:
        param = "prompt" if num_prompt > capacity else "max_tokens"
        raise InvalidParameterError(
            param,
            f"{param}: prompt ({num_prompt} tokens) + max_tokens needs {needed} tokens of KV cache, but the whole "
            f"cache holds {capacity} ({scheduler.block_manager.num_usable_blocks} blocks of {scheduler.block_size}); lower "
            f"max_tokens or give the KV cache more memory (--kv-cache-memory / num_gpu_blocks_override)",
        )
    if not scheduler._can_chunk(request, num_prompt) and num_prompt > scheduler.max_num_batched_tokens:
        raise InvalidParameterError(
            "prompt",
            f"prompt: {num_prompt} tokens exceed max_num_batched_tokens ({scheduler.max_num_batched_tokens}) and "
            f"{'pooling prompts are' if request.is_pooling else 'chunked prefill is off, so a prompt is'} never split "
            f"across steps; raise --max-num-batched-tokens",
        )
    for k, feature in enumerate(request.mm_features):
        limit = min(scheduler.encoder_budget, scheduler.encoder_cache.capacity)
        if feature.length > limit:
            raise InvalidParameterError(
                "multi_modal_data",
                f"multi_modal_data: image {k} takes {feature.length} tokens, more than the engine encodes in one "
                f"step ({limit}); raise --max-num-batched-tokens or send a smaller image",
            )


def check_siblings_fit(scheduler: "Scheduler", requests: Sequence[Request]) -> None:
    """The `n` sequences of one prompt must fit in the KV cache together.

    Refused up front when they cannot, rather than left to preempt one another. The
    prompt's full blocks are counted once when prefix caching shares them.

    :raises InvalidParameterError: on `n`, with the blocks needed and the cache's size.
    """
    generating = [r for r in requests if not r.is_pooling]
    if len(generating) < 2:
        return
    bs = scheduler.block_size
    num_prompt = generating[0].num_prompt_tokens
    per_sequence = [-(-min(num_prompt + r.max_tokens, scheduler.max_model_len) // bs) for r in generating]
    shared = num_prompt // bs if scheduler.block_manager.enable_caching else 0
    needed = shared + sum(blocks - shared for blocks in per_sequence)
    usable = scheduler.block_manager.num_usable_blocks
    if needed > usable:
        raise InvalidParameterError(
            "n",
            f"n: {len(generating)} sequences of a {num_prompt}-token prompt with max_tokens "
            f"{generating[0].max_tokens} need {needed} KV blocks together, but the cache holds {usable} "
            f"(blocks of {bs}); lower n or max_tokens",
        )


def check_stop(request: Request, token: int, max_model_len: int) -> bool:
    """Whether `token` (just appended) ends the request, setting its status: vLLM's order,
    EOS, then stop tokens (neither before min_tokens), then length."""
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if params is None or num_output >= params.min_tokens:
        if token in request.eos_token_ids and not (params is not None and params.ignore_eos):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None
            return True
        if params is not None and params.stop_token_ids and token in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
            return True
    if num_output >= request.max_tokens or len(request.prompt_token_ids) + num_output >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False


def lora_fits(scheduler: "Scheduler", request: Request) -> bool:
    """Whether `request`'s adapter may join the running requests: they use at most
    `max_loras` adapters, so every step's adapters fit the runner's slots."""
    max_loras = scheduler.max_loras
    wanted = request.lora_request.lora_int_id
    running = {r.lora_request.lora_int_id for r in scheduler.running if r.lora_request is not None}
    return wanted in running or len(running) < max_loras


def append_tokens(request: Request, runner_output: Any, rid: str, token: int, plp: Any, max_model_len: int,
                  spec_stats: Any = None, num_drafts: int = 0) -> EngineCoreOutput:
    """Append a step's new tokens to `request` (the accepted proposals, then the sampled
    token), stopping at the first one that ends it, and report them. With proposals, the
    computed tokens roll back to the accepted ones: the rejected positions are written
    again by the next step."""
    accepted = runner_output.accepted_token_ids.get(rid, ())
    tokens = (*accepted, token)
    lps = runner_output.accepted_logprobs.get(rid, ())
    last = runner_output.logprobs.get(rid) if runner_output.logprobs else None
    all_lps = (*lps, last) if last is not None else ()
    finished = False
    kept = 0
    for t in tokens:
        request.output_token_ids.append(t)
        kept += 1
        if check_stop(request, t, max_model_len):
            finished = True
            break
    if spec_stats is not None:
        spec_stats.record(num_drafts, len(accepted))
        request.num_computed_tokens = request.num_tokens - 1
        request.spec_k = next_num_drafts(num_drafts, len(accepted), spec_stats.max_k)
    return EngineCoreOutput(
        req_id=rid,
        new_token_ids=tokens[:kept],
        new_logprobs=all_lps[:kept] if len(all_lps) == len(tokens) else (),
        prompt_logprobs=plp,
        finish_reason=request.finish_reason if finished else None,
        stop_reason=request.stop_reason,
        num_cached_tokens=request.num_cached_tokens,
    )
