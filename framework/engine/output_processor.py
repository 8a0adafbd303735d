"""Front-end output processing: engine-core token deltas to RequestOutputs.

Per completion it detokenizes incrementally, matches stop strings (which end the
request: the caller tells the core to finish it), and keeps logprobs with their
decoded tokens; per user request it gathers the n completions and decides what to emit
for the request's output kind (cumulative, delta or final only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from portaserve.framework.engine.detokenizer import RequestDetokenizer
from portaserve.framework.engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from portaserve.framework.engine.params import PoolingParams, RequestOutputKind, SamplingParams
from portaserve.framework.engine.processor import ProcessedRequest
from portaserve.framework.engine.scheduler_output import EngineCoreOutput, Logprobs
from portaserve.framework.errors import RequestFailedError


@dataclass(slots=True)
class _Child:
    index: int
    req_id: str
    detok: RequestDetokenizer | None
    params: SamplingParams | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for DELTA outputs
    num_sent_logprobs: int = 0
    finished_sent: bool = False


@dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    children: list[_Child]
    metrics: RequestMetrics
    output_kind: RequestOutputKind
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    embedding: list[float] | None = None
    error: str | None = None  # the request failed (in the engine, or detokenizing here)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    """Keeps every in-flight user request's front-end state."""

    def __init__(self, tokenizer: Any | None, weights_version: int = 0) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, _Parent] = {}
        self.weights_version = weights_version

    def add_request(self, processed: ProcessedRequest) -> None:
        params = processed.params
        children = []
        for i, req in enumerate(processed.children):
            sp = req.sampling_params
            detok = RequestDetokenizer(self.tokenizer, sp, processed.prompt_token_ids) if sp is not None else None
            logprobs = [] if sp is not None and sp.logprobs is not None else None
            cum = 0.0 if logprobs is not None else None
            children.append(_Child(i, req.request_id, detok, sp, logprobs=logprobs, cumulative_logprob=cum))
        kind = params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.FINAL_ONLY
        parent = _Parent(
            processed.request_id,
            processed.prompt,
            list(processed.prompt_token_ids),
            params,
            children,
            RequestMetrics(arrival_time=processed.arrival_time),
            kind,
        )
        self.parents[processed.request_id] = parent
        for child in children:
            self.child_to_parent[child.req_id] = parent

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.req_id for c in parent.children] if parent else []

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Mark a user request aborted and return its final output (None if unknown)."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            if child.finish_reason is None:
                child.finish_reason = "abort"
        out = self._make_output(parent, force=True)
        self._forget(parent)
        return out

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput | EmbeddingRequestOutput], list[str]]:
        """Apply one step's core outputs; returns the RequestOutputs to emit and the child
        request ids the core must finish because a stop string matched."""
        now = time.monotonic()
        touched: dict[str, _Parent] = {}
        to_finish: list[str] = []
        for out in outputs:
            parent = self.child_to_parent.get(out.req_id)
            if parent is None:
                continue  # aborted by the front end already
            child = next(c for c in parent.children if c.req_id == out.req_id)
            try:
                if out.error is not None:
                    raise RequestFailedError(out.error)
                if self._apply(parent, child, out, now):
                    to_finish.append(child.req_id)
            except Exception as exc:
                # this request alone fails (an engine-side failure, a detokenizer error);
                # its siblings still running in the core are stopped with it
                parent.error = parent.error or (str(exc) if isinstance(exc, RequestFailedError)
                                                else f"{type(exc).__name__}: {exc}")
                for c in parent.children:
                    if c.finish_reason is None:
                        c.finish_reason = "error"
                        if c is not child:
                            to_finish.append(c.req_id)
            touched[parent.request_id] = parent
        emitted: list[RequestOutput | EmbeddingRequestOutput] = []
        for parent in touched.values():
            out = self._make_output(parent)
            if out is not None:
                emitted.append(out)
            if parent.finished:
                parent.metrics.finished_time = now
                self._forget(parent)
        return emitted, to_finish

    def _forget(self, parent: _Parent) -> None:
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.child_to_parent.pop(child.req_id, None)

    def _apply(self, parent: _Parent, child: _Child, out: EngineCoreOutput, now: float) -> bool:
        """Fold one core output into `child`; True when a stop string ended it here."""
        metrics = parent.metrics
        if out.num_cached_tokens:
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if out.pooler_output is not None:
            parent.embedding = list(out.pooler_output)
            child.finish_reason = out.finish_reason or "stop"
            return False
        if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None] + [self._logprob_entry(lp) for lp in out.prompt_logprobs]
        new_ids = list(out.new_token_ids)
        stopped_by_string = False
        if new_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.num_generation_tokens += len(new_ids)
            child.token_ids.extend(new_ids)
            if child.logprobs is not None:
                for lp in out.new_logprobs:
                    child.logprobs.append(self._logprob_entry(lp))
                    child.cumulative_logprob += lp.logprob
            if child.detok is not None:
                stop_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
                matched = child.detok.update(new_ids, stop_terminated=stop_token)
                cut = getattr(child.detok, "stop_cut", None)
                if matched is not None and cut is not None and cut < len(new_ids):
                    # tokens after the stop string (a speculative step's) are not output
                    extra = len(new_ids) - cut
                    del child.token_ids[-extra:]
                    if child.logprobs is not None and len(child.logprobs) >= extra and out.new_logprobs:
                        for lp in out.new_logprobs[cut:]:
                            child.cumulative_logprob -= lp.logprob
                        del child.logprobs[-extra:]
                    metrics.num_generation_tokens -= extra
                if matched is not None and (out.finish_reason is None or cut is not None and cut < len(new_ids)):
                    child.finish_reason = "stop"
                    child.stop_reason = matched
                    stopped_by_string = out.finish_reason is None  # else the core has finished it
        if out.finish_reason is not None and child.finish_reason is None:
            child.finish_reason = out.finish_reason
            child.stop_reason = out.stop_reason
        return stopped_by_string

    def _logprob_entry(self, lp: Logprobs) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        for tid, val, rank in zip(lp.top_token_ids, lp.top_logprobs, range(1, len(lp.top_token_ids) + 1)):
            entry[tid] = Logprob(val, rank, self._decode_one(tid))
        if lp.token_id not in entry:
            entry[lp.token_id] = Logprob(lp.logprob, lp.rank, self._decode_one(lp.token_id))
        else:
            entry[lp.token_id] = Logprob(lp.logprob, lp.rank, entry[lp.token_id].decoded_token)
        # the sampled token first, as vLLM orders it
        first = {lp.token_id: entry.pop(lp.token_id)}
        first.update(entry)
        return first

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _make_output(self, parent: _Parent, force: bool = False) -> RequestOutput | EmbeddingRequestOutput | None:
        if isinstance(parent.params, PoolingParams):
            if parent.embedding is None and not force:
                return None
            return EmbeddingRequestOutput(
                parent.request_id, parent.prompt_token_ids, EmbeddingOutput(parent.embedding or []), True, parent.metrics
            )
        finished = parent.finished
        kind = parent.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished and not force:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = []
        for child in parent.children:
            if delta:
                new_tokens = child.token_ids[child.num_sent_tokens :]
                child_done = child.finish_reason is not None
                if not new_tokens and not (child_done and not child.finished_sent) and not force:
                    continue
                text = child.detok.get_next_output_text(child_done, delta=True) if child.detok else ""
                logprobs = child.logprobs[child.num_sent_logprobs :] if child.logprobs is not None else None
                child.num_sent_tokens = len(child.token_ids)
                if child.logprobs is not None:
                    child.num_sent_logprobs = len(child.logprobs)
                child.finished_sent = child_done
                token_ids = new_tokens
            else:
                text = child.detok.get_next_output_text(child.finish_reason is not None, delta=False) if child.detok else ""
                logprobs = list(child.logprobs) if child.logprobs is not None else None
                token_ids = list(child.token_ids)
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                )
            )
        if not completions and not finished:
            return None
        prompt_logprobs = None
        if parent.prompt_logprobs is not None and (not delta or not parent.prompt_logprobs_sent):
            prompt_logprobs = parent.prompt_logprobs
            parent.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
            weights_version=self.weights_version,
            error=parent.error,
        )
