"""The scheduler: which requests run each step, and how many tokens each computes.

vLLM v1's unified scheme, pure Python (no tensors, no vendor checks):

- One token budget per step (`max_num_batched_tokens`) and at most `max_num_seqs`
  running requests. Running requests are served first (a decode is 1 token, an
  unfinished prompt gets its next chunk), then waiting ones; each request gets
  `min(tokens it still has to compute, budget left)`. With chunked prefill off a
  waiting prompt that does not fit the budget left waits for a later step (a request
  resumed after preemption whose prompt + outputs exceed the whole budget is chunked
  anyway, so it can never wait forever; pooling prompts are never chunked: encoders
  attend bidirectionally).
- When a running request cannot get a block, the lowest-priority running request (FCFS:
  the last admitted) is preempted by recompute: its blocks are freed, its computed
  tokens reset to 0 (outputs kept) and it goes back to the front of the waiting queue;
  it returns to the runner as a NewRequestData carrying its output tokens. No waiting
  request is admitted in a step that preempted.
- Priority policy: lower `priority` first, then earlier arrival. A waiting request
  that lacks blocks or a sequence slot preempts strictly lower-priority running ones.
- `update_from_output` appends sampled tokens, applies the stop rules (EOS unless
  ignore_eos, then stop_token_ids — neither before min_tokens — then max_tokens and
  max_model_len), frees finished requests and returns their EngineCoreOutputs.
- A chunk reaching an image's placeholders needs its encoder output: cached
  (encoder_cache.py) or encoded this step within the encoder budget, else the chunk
  stops before the image. Structured outputs: a request waits outside the queue while
  its grammar compiles; each step carries the bitmask rows of the sequences it samples.
  LoRA: running requests use at most `max_loras` adapters (admission.py).

`request.num_computed_tokens` always counts tokens whose K/V is written (or will be,
by the step just scheduled): `schedule()` advances it for everything it scheduled.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from portaserve.framework.errors import invalid

from .admission import append_tokens, check_request_fits, check_siblings_fit, lora_fits
from .block_manager import BlockManager
from .encoder_cache import EncoderCacheManager
from .request_queue import FcfsQueue, PriorityQueue
from .request import Request, RequestStatus
from .scheduler_output import (CachedRequestData, EngineCoreOutput, Logprobs, ModelRunnerOutput, NewRequestData,
                               SchedulerOutput, SchedulerStats)
from .speculative import SpecStats, draft_limit, make_proposer, may_speculate

SCHEDULING_POLICIES = ("fcfs", "priority")
#: image embeddings the encoder may compute per step when the token budget is smaller
MIN_ENCODER_BUDGET = 2048


class _Step:
    """What one `schedule()` call has decided so far."""

    __slots__ = ("budget", "prefill_budget", "num_scheduled", "new_blocks", "new_requests", "admitted", "preempted",
                 "encoder_budget", "encoder_inputs", "drafts", "grammar_rows")

    def __init__(self, budget: int, prefill_budget: int, encoder_budget: int = 0) -> None:
        self.budget = budget
        # tokens left for prompt chunks (<= budget; smaller while decodes run, see Scheduler)
        self.prefill_budget = prefill_budget
        self.num_scheduled: dict[str, int] = {}  # in scheduling order
        self.new_blocks: dict[str, list[int]] = {}  # running requests' blocks added this step
        self.new_requests: list[Request] = []
        self.admitted: set[str] = set()
        self.preempted: set[str] = set()
        self.encoder_budget = encoder_budget  # image embeddings left to encode this step
        self.encoder_inputs: list = []  # MultiModalFeatures the runner encodes this step
        self.drafts: dict[str, tuple[int, ...]] = {}  # proposals scheduled with a decode
        self.grammar_rows: dict[str, Any] = {}  # bitmask rows per position of constrained proposals


class Scheduler:
    """Continuous batching over a `BlockManager`."""

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        block_manager: BlockManager,
        enable_chunked_prefill: bool = True,
        scheduling_policy: str = "fcfs",
        max_prefill_tokens_with_decodes: int | None = None,
        encoder_budget: int | None = None,
        encoder_cache_size: int | None = None,
        structured: Any = None,
        max_loras: int = 1,
        speculative: Any = None,
    ) -> None:
        if max_prefill_tokens_with_decodes is not None and (
            not isinstance(max_prefill_tokens_with_decodes, int) or max_prefill_tokens_with_decodes < 1
        ):
            raise invalid(
                "max_prefill_tokens_with_decodes", f"must be an integer >= 1 or None, got {max_prefill_tokens_with_decodes!r}"
            )
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if not isinstance(value, int) or value < 1:
                raise invalid(name, f"must be an integer >= 1, got {value!r}")
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise invalid("scheduling_policy", f"must be one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}")
        if block_size != block_manager.block_size:
            raise invalid("block_size", f"{block_size} differs from the block manager's {block_manager.block_size}")
        self.max_num_seqs, self.max_loras = max_num_seqs, max_loras
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.enable_chunked_prefill = enable_chunked_prefill
        # While any request is decoding, a step takes at most this many prompt tokens
        # (chunked prefill only): it bounds how long a decode waits behind other requests'
        # prompts (inter-token latency) without shrinking the prefill-only steps.
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.policy = scheduling_policy
        self.block_manager = block_manager
        # structured outputs (framework/structured/manager.py); requests whose grammar is
        # compiling wait here, outside the queue, so they hold up no one
        self.structured = structured
        self._compiling: dict[str, Request] = {}
        # image embeddings encoded per step (at least one large image's, even under a small
        # token budget: a chunk may then end inside it) and kept between steps
        self.encoder_budget = encoder_budget or max(max_num_batched_tokens, MIN_ENCODER_BUDGET)
        self.encoder_cache = EncoderCacheManager(encoder_cache_size or max(4 * self.encoder_budget, 8192))

        self.requests: dict[str, Request] = {}  # every unfinished request
        self.running: list[Request] = []  # FCFS: admission order; priority: sorted by _key
        self._order: dict[str, int] = {}  # req_id -> order added, the final tie-break
        self._counter = itertools.count()
        self.waiting = PriorityQueue(self._key) if scheduling_policy == "priority" else FcfsQueue()
        # Told to the runner with the next non-empty step (it drops their state).
        self._finished_ids: set[str] = set()
        # EngineCoreOutputs not tied to a step (aborts), returned by the next update.
        self._pending_outputs: list[EngineCoreOutput] = []
        # Prompt logprobs arrive per prefill chunk; they are sent once, whole.
        self._prompt_logprobs: dict[str, list[Logprobs]] = {}
        self._prompt_logprobs_sent: set[str] = set()
        self.num_preemptions = 0
        self.num_steps = 0
        # speculative decoding (speculative.py): proposals per decoding request and step
        self.proposer = make_proposer(speculative)
        self.spec_stats = SpecStats(speculative.num_speculative_tokens if speculative is not None else 0)

    # ----- requests in and out ---------------------------------------------------

    def _key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time, self._order[request.request_id])

    def add_request(self, request: Request) -> None:
        """Queue a request; raises InvalidParameterError if it can never be served."""
        rid = request.request_id
        if rid in self.requests:
            raise invalid("request_id", f"{rid!r} is already in use by an unfinished request")
        check_request_fits(self, request)
        params = request.sampling_params
        if params is not None and params.structured_outputs is not None and self.structured is None:
            raise invalid("structured_outputs", "this engine has no structured-outputs backend")
        request.status = RequestStatus.WAITING
        self._order[rid] = next(self._counter)
        self.requests[rid] = request
        if params is not None and params.structured_outputs is not None:
            self.structured.submit(request)
            self._compiling[rid] = request
        else:
            self.waiting.push(request)

    def check_siblings_fit(self, requests: Sequence[Request]) -> None:
        """The `n` sequences of one prompt must fit in the KV cache together (admission.py)."""
        check_siblings_fit(self, requests)

    def abort_requests(self, req_ids: Iterable[str] | str) -> None:
        """End requests now, wherever they are; unknown or finished ids are ignored.

        Each one is reported by the next `update_from_output` with finish_reason "abort".
        """
        for request in self._take(req_ids, RequestStatus.FINISHED_ABORTED):
            self._pending_outputs.append(
                EngineCoreOutput(
                    req_id=request.request_id,
                    new_token_ids=(),
                    finish_reason=request.finish_reason,
                    num_cached_tokens=request.num_cached_tokens,
                )
            )

    def finish_requests(self, req_ids: Iterable[str] | str, status: RequestStatus) -> None:
        """End requests the front end stopped (a stop string matched); no output is sent."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        self._take(req_ids, status)

    def _take(self, req_ids: Iterable[str] | str, status: RequestStatus) -> list[Request]:
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        taken = []
        for rid in req_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif self._compiling.pop(rid, None) is None:
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            taken.append(request)
        return taken

    def _release(self, request: Request) -> None:
        """Forget a finished request and free its blocks."""
        rid = request.request_id
        self.block_manager.free(request)
        del self.requests[rid]
        self._order.pop(rid, None)
        self._finished_ids.add(rid)
        self._prompt_logprobs.pop(rid, None)
        self._prompt_logprobs_sent.discard(rid)
        if request.mm_features:
            self.encoder_cache.release(rid, keys=[f.hash for f in request.mm_features])

    def has_unfinished_requests(self) -> bool:
        """True while requests remain or an abort is still to be reported."""
        return bool(self.requests) or bool(self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes (after a weight update); False while requests hold blocks."""
        return self.block_manager.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        cache = bm.stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_usable_blocks,
            prefix_cache_queries=cache.num_queries,
            prefix_cache_hits=cache.num_hits,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
            encoder_cache_misses=self.encoder_cache.num_encoded,
            encoder_cache_hits=self.encoder_cache.num_hits,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
        )

    # ----- scheduling ------------------------------------------------------------

    def _can_chunk(self, request: Request, num_new_tokens: int) -> bool:
        if request.is_pooling:
            return False
        # A resumed request longer than any step's budget must be split to run at all.
        return self.enable_chunked_prefill or (bool(request.output_token_ids) and num_new_tokens > self.max_num_batched_tokens)

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch; advances each scheduled request's num_computed_tokens."""
        if self._compiling:
            self._admit_compiled()
        step = _Step(self.max_num_batched_tokens, self._prefill_budget(), self.encoder_budget)
        preempted_running = self._schedule_running(step)
        if not preempted_running:
            self._schedule_waiting(step)
        return self._build_output(step)

    def _prefill_budget(self) -> int:
        cap = self.max_prefill_tokens_with_decodes
        if cap is None or not self.enable_chunked_prefill or cap >= self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens <= 1:
                return cap  # someone is decoding
        return self.max_num_batched_tokens

    def _schedule_running(self, step: _Step) -> bool:
        allocate = self.block_manager.allocate_slots
        running = self.running
        num_scheduled = step.num_scheduled
        step_new_blocks = step.new_blocks
        budget = step.budget
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = len(request.prompt_token_ids) + len(request.output_token_ids) - request.num_computed_tokens
            is_prefill = num_new > 1
            if num_new == 1 and self.proposer is not None and may_speculate(request, self.proposer):
                drafts = self._propose(request, budget - 1, step)
                if drafts:
                    step.drafts[request.request_id] = drafts
                    num_new += len(drafts)
            if num_new > budget:
                num_new = budget
            if is_prefill and num_new > step.prefill_budget:
                num_new = step.prefill_budget
            encoder_plan = None
            if request.mm_features and num_new > 0:
                num_new, encoder_plan = self._plan_encoder(request, request.num_computed_tokens, num_new, step)
            if num_new <= 0:
                i += 1
                continue
            new_blocks = allocate(request, num_new)
            while new_blocks is None:
                # The victim is at or after index i: never one already scheduled this step.
                victim = running.pop()
                self._preempt(victim, step)
                preempted = True
                if victim is request:
                    break
                new_blocks = allocate(request, num_new)
            if new_blocks is None:
                step.drafts.pop(request.request_id, None)
                break
            rid = request.request_id
            if encoder_plan is not None:
                self._commit_encoder(request, encoder_plan, step)
            num_scheduled[rid] = num_new
            step_new_blocks[rid] = new_blocks
            budget -= num_new
            if is_prefill:
                step.prefill_budget -= num_new
            i += 1
        step.budget = budget
        return preempted

    def _propose(self, request: Request, budget: int, step: _Step) -> tuple[int, ...]:
        k = min(draft_limit(request, request.spec_k or self.proposer.k, self.max_model_len), budget)
        drafts = self.proposer.propose(request.prompt_token_ids + request.output_token_ids, k) if k > 0 else ()
        if drafts and request.grammar is not None:  # the prefix its grammar allows, a mask row per position
            drafts, step.grammar_rows[request.request_id] = self.structured.draft_rows(request, drafts)
        return drafts

    def _schedule_waiting(self, step: _Step) -> None:
        bm = self.block_manager
        waiting = self.waiting
        while len(waiting) and step.budget > 0 and step.prefill_budget > 0:
            request = waiting.peek()
            if request.request_id in step.preempted:
                break  # it just made room for a better request
            if len(self.running) >= self.max_num_seqs:
                if self._make_room(request, step):
                    continue
                break
            if request.lora_request is not None and not lora_fits(self, request):
                break  # FCFS: it waits for an adapter slot, and keeps its place
            hit_blocks, num_hit = bm.get_computed_blocks(request, record_stats=False)
            num_new = request.num_tokens - num_hit
            if num_new > min(step.budget, step.prefill_budget) and not self._can_chunk(request, num_new):
                break
            num_new = min(num_new, step.budget, step.prefill_budget)
            encoder_plan = None
            if request.mm_features:
                wanted = num_new
                num_new, encoder_plan = self._plan_encoder(request, num_hit, num_new, step)
                if num_new <= 0 or (num_new < wanted and not self._can_chunk(request, wanted)):
                    break
            new_blocks = bm.allocate_slots(request, num_new, hit_blocks)
            if new_blocks is None:
                if self._make_room(request, step):
                    continue
                break
            waiting.pop()
            if encoder_plan is not None:
                self._commit_encoder(request, encoder_plan, step)
            bm.record_query(request.num_tokens, num_hit)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_hit
            if self.policy == "priority":
                bisect.insort(self.running, request, key=self._key)
            else:
                self.running.append(request)
            step.new_requests.append(request)
            step.admitted.add(request.request_id)
            step.num_scheduled[request.request_id] = num_new
            step.budget -= num_new
            step.prefill_budget -= num_new

    def _make_room(self, request: Request, step: _Step) -> bool:
        """Priority policy: preempt one running request strictly worse than `request`.

        A victim already scheduled this step is taken out of it again, unless another
        request hit one of the blocks it was about to write.
        """
        if self.policy != "priority":
            return False
        key = self._key(request)
        bm = self.block_manager
        for victim in reversed(self.running):
            if self._key(victim) <= key:
                return False
            rid = victim.request_id
            if rid in step.admitted:
                continue
            if rid in step.num_scheduled and bm.has_shared_uncomputed_blocks(victim, victim.num_computed_tokens):
                continue
            if rid in step.num_scheduled:
                returned = step.num_scheduled.pop(rid)
                step.budget += returned
                if returned > 1 and step.drafts.pop(rid, None) is None:
                    step.prefill_budget += returned
                step.new_blocks.pop(rid, None)
            self.running.remove(victim)
            self._preempt(victim, step)
            return True
        return False

    def _preempt(self, request: Request, step: _Step) -> None:
        rid = request.request_id
        # num_computed_tokens has not been advanced for this step yet, so it marks where
        # blocks allocated (and hashed) this step but never written begin.
        self.block_manager.free(request, request.num_computed_tokens)
        if request.mm_features:
            self.encoder_cache.release(rid, keys=[f.hash for f in request.mm_features])
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_preempted(request)
        self._finished_ids.add(rid)
        step.preempted.add(rid)
        if rid not in self._prompt_logprobs_sent:
            self._prompt_logprobs.pop(rid, None)  # the prompt is recomputed from 0

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready join the queue; one whose compile failed ends."""
        for rid, request in list(self._compiling.items()):
            if not self.structured.poll(request):
                continue
            del self._compiling[rid]
            if request.grammar.error is None:
                self.waiting.push(request)
            else:
                self._fail(request, request.grammar.error, self._pending_outputs)

    def _fail(self, request: Request, message: str, outputs: list[EngineCoreOutput]) -> None:
        """End this request alone with an error (the rest of the batch goes on)."""
        request.status = RequestStatus.FINISHED_ERROR
        outputs.append(EngineCoreOutput(req_id=request.request_id, new_token_ids=(), finish_reason=request.finish_reason,
                                        num_cached_tokens=request.num_cached_tokens, error=message))
        self._release(request)

    def _plan_encoder(self, request: Request, start: int, num_new: int, step: _Step):
        return self.encoder_cache.plan(request.mm_features, start, num_new, step.encoder_budget)

    def _commit_encoder(self, request: Request, plan, step: _Step) -> None:
        encoded = self.encoder_cache.commit(request.request_id, plan)
        step.encoder_budget -= sum(f.length for f in encoded)
        step.encoder_inputs += encoded

    def _build_output(self, step: _Step) -> SchedulerOutput:
        bm = self.block_manager
        requests = self.requests
        new_data = tuple(
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=tuple(r.prompt_token_ids),
                output_token_ids=tuple(r.output_token_ids),
                sampling_params=r.sampling_params,
                pooling_params=r.pooling_params,
                block_ids=bm.block_ids(r),
                num_computed_tokens=r.num_computed_tokens,
                # placements and hashes only: pixels travel once, in scheduled_encoder_inputs
                mm_features=tuple(replace(f, pixel_values=b"") for f in r.mm_features),
                lora_request=r.lora_request,
            )
            for r in step.new_requests
        )
        cached_data = tuple(
            CachedRequestData(rid, tuple(blocks), requests[rid].num_computed_tokens) for rid, blocks in step.new_blocks.items()
        )
        num_scheduled = step.num_scheduled
        for rid, n in num_scheduled.items():
            request = requests[rid]
            request.num_computed_tokens += n
            if request.mm_features:  # images wholly consumed no longer need their encoder output
                self.encoder_cache.release(rid, keys=[f.hash for f in request.mm_features if f.end <= request.num_computed_tokens])
        total = sum(num_scheduled.values())
        finished = frozenset(self._finished_ids)
        constrained = [r for r in (requests[rid] for rid in num_scheduled)
                       if r.grammar is not None and r.num_computed_tokens >= r.num_tokens]  # they sample this step
        grammar_ids, grammar_bitmask, grammar_rows = (self.structured.bitmask(constrained, step.grammar_rows)
                                                      if constrained else ((), b"", ()))
        if total:
            # An engine may skip the runner on an empty step, so keep the ids until a
            # step that reaches it (the runner ignores ids it does not know).
            self._finished_ids = set()
            self.num_steps += 1
        return SchedulerOutput(
            new_requests=new_data,
            cached_requests=cached_data,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished,
            scheduled_encoder_inputs=tuple(step.encoder_inputs),
            free_encoder_hashes=self.encoder_cache.take_freed(),
            grammar_req_ids=grammar_ids,
            grammar_bitmask=grammar_bitmask,
            grammar_rows=grammar_rows,
            spec_token_ids=dict(step.drafts),
        )

    # ----- results ---------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput | None) -> list[EngineCoreOutput]:
        """Apply one step's results; returns an output per request that produced something."""
        outputs = self._pending_outputs
        self._pending_outputs = []
        if runner_output is None:
            return outputs
        sampled = runner_output.sampled_token_ids
        errors = runner_output.errors
        prompt_logprobs = runner_output.prompt_logprobs
        pooled = runner_output.pooler_output
        requests = self.requests
        running_status = RequestStatus.RUNNING
        sent = self._prompt_logprobs_sent
        max_model_len = self.max_model_len
        any_finished = False
        for rid in scheduler_output.num_scheduled_tokens:
            request = requests.get(rid)
            if request is None or request.status is not running_status:
                continue  # aborted or finished since it was scheduled
            params = request.sampling_params
            plp = None
            if params is not None and params.prompt_logprobs is not None and rid not in sent:
                plp = self._collect_prompt_logprobs(request, prompt_logprobs.get(rid))
            if request.pooling_params is not None:
                embedding = pooled.get(rid)
                if embedding is None:
                    continue
                request.status = RequestStatus.FINISHED_STOPPED
                outputs.append(
                    EngineCoreOutput(
                        req_id=rid,
                        new_token_ids=(),
                        finish_reason=request.finish_reason,
                        num_cached_tokens=request.num_cached_tokens,
                        pooler_output=tuple(embedding),
                    )
                )
                self._release(request)
                any_finished = True
                continue
            token = sampled.get(rid)
            if token is None and rid in errors:
                self._fail(request, errors[rid], outputs)
                any_finished = True
                continue
            if token is None:
                if plp is not None:
                    outputs.append(EngineCoreOutput(req_id=rid, new_token_ids=(), prompt_logprobs=plp,
                                                    num_cached_tokens=request.num_cached_tokens))
                continue
            refused = None if request.grammar is None else self.structured.accept_all(
                request, (*runner_output.accepted_token_ids.get(rid, ()), token))
            if refused is not None:
                self._fail(request, f"structured outputs: the grammar refused the sampled token {refused}", outputs)
                any_finished = True
                continue
            drafts = scheduler_output.spec_token_ids.get(rid)
            out = append_tokens(request, runner_output, rid, token, plp, max_model_len, self.spec_stats if drafts else None,
                                len(drafts) if drafts else 0)
            outputs.append(out)
            finished = out.finish_reason is not None
            if finished:
                self._release(request)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is running_status]
        return outputs

    def _collect_prompt_logprobs(self, request: Request, chunk) -> tuple[Logprobs, ...] | None:
        """Accumulate a prefill chunk's prompt logprobs; the whole tuple once the prompt is done."""
        rid = request.request_id
        acc = self._prompt_logprobs.setdefault(rid, [])
        if chunk:
            acc.extend(chunk)
        if request.num_computed_tokens < request.num_prompt_tokens:
            return None
        del self._prompt_logprobs[rid]
        self._prompt_logprobs_sent.add(rid)
        return tuple(acc)
