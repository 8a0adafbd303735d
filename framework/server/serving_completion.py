"""`/v1/completions`: one or several prompts (text or token ids), `echo`, logprobs in the legacy shape.

Choices are numbered prompt by prompt: prompt i's completions are `i * n ... i * n + n - 1`.
With `echo` and `logprobs`, the prompt's tokens (and their logprobs, the first one None)
come before the completion's, as in OpenAI's API.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from portaserve.framework.engine.params import RequestOutputKind, SamplingParams
from portaserve.framework.errors import invalid
from portaserve.framework.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from portaserve.framework.server.serving_common import (
    SSEResponse,
    TokenText,
    base_request_id,
    completion_logprobs,
    engine_outputs,
    engine_request_id,
    make_usage,
    merge,
    prime,
    prompt_logprobs_json,
    sse,
    sse_stream,
    until_disconnected,
)
from portaserve.framework.server.state import ServerState
from portaserve.framework.server.tracing import end_span


@dataclass(slots=True)
class _Prompt:
    text: str | None
    ids: list[int]
    engine_id: str


@dataclass(slots=True)
class CompletionPlan:
    request: CompletionRequest
    model: str
    response_id: str
    prompts: list[_Prompt]
    params: SamplingParams
    created: int = field(default_factory=lambda: int(time.time()))


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt", "must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


class CompletionService:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def plan(self, req: CompletionRequest, raw: Request) -> CompletionPlan:
        state = self.state
        engine = state.require_engine()
        model = state.check_model(req.model)
        req.unsupported_fields()
        limits = state.settings.limits
        num_prompts = limits.check_prompts("prompt", req.prompt, "max_prompts")
        limits.check_sampling(req, num_prompts)
        limits.check_truncate(req.truncate_prompt_tokens, state.spec.max_model_len)
        state.check_priority(req.priority)
        tokenizer = engine.tokenizer
        response_id = f"cmpl-{base_request_id(raw, req.request_id)}"
        prompts = []
        for i, p in enumerate(_prompt_list(req.prompt)):
            if isinstance(p, str):
                if tokenizer is None:
                    raise invalid("prompt", "this server was started without a tokenizer; pass token ids")
                ids = tokenizer.encode(p, add_special_tokens=req.add_special_tokens)
                text = p
            else:
                ids = list(p)
                text = None
            if req.truncate_prompt_tokens is not None:
                ids = ids[-req.truncate_prompt_tokens:]
            prompts.append(_Prompt(text, ids, engine_request_id(f"{response_id}-{i}")))
        logprobs = req.logprobs
        params = SamplingParams(
            **req.sampling_kwargs(),
            max_tokens=req.max_tokens,
            logprobs=logprobs,
            output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
        )
        if req.echo and logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = logprobs
        limits.check_prompt_logprobs(params.prompt_logprobs, sum(len(p.ids) for p in prompts))
        return CompletionPlan(req, model, response_id, prompts, params)

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        return await until_disconnected(raw, self._create(req, raw))

    def _token_text(self, req: CompletionRequest) -> TokenText:
        as_ids = req.return_tokens_as_token_ids if req.return_tokens_as_token_ids is not None else self.state.settings.return_tokens_as_token_ids
        return TokenText(self.state.engine.tokenizer, bool(as_ids))

    def _prompt_text(self, p: _Prompt) -> str:
        if p.text is not None:
            return p.text
        tok = self.state.engine.tokenizer
        return tok.decode(p.ids, skip_special_tokens=False) if tok is not None else ""

    async def _create(self, req: CompletionRequest, raw: Request) -> Response:
        plan = self.plan(req, raw)
        gens = []
        try:
            for p in plan.prompts:
                params = plan.params.clone() if len(plan.prompts) > 1 else plan.params
                gen = engine_outputs(
                    self.state, p.engine_id, {"prompt": p.text, "prompt_token_ids": p.ids}, params,
                    num_prompt_tokens=len(p.ids), priority=req.priority, cache_salt=req.cache_salt,
                    lora_request=self.state.lora_for(plan.model),
                )
                gens.append(await prime(gen))
        except BaseException:
            for _, g in gens:
                await g.aclose()
            raise
        span = self.state.tracer.start("completions", raw.headers, **{
            "gen_ai.request.id": plan.response_id, "gen_ai.request.model": plan.model,
            "gen_ai.request.max_tokens": plan.params.max_tokens, "gen_ai.request.n": plan.params.n,
            "gen_ai.usage.prompt_tokens": sum(len(p.ids) for p in plan.prompts),
        })
        if req.stream:
            return SSEResponse(sse_stream(self._traced(self._stream(plan, gens), span)))
        try:
            finals = []
            for first, gen in gens:
                final = first
                async for out in gen:
                    final = out
                finals.append(final)
            body = self._full_response(plan, finals)
        except BaseException as exc:
            end_span(span, exc)
            raise
        end_span(span, **{"gen_ai.usage.completion_tokens": body.usage.completion_tokens})
        return JSONResponse(body.model_dump(mode="json"))

    @staticmethod
    async def _traced(events: AsyncIterator[str], span: Any) -> AsyncIterator[str]:
        error = None
        try:
            async for event in events:
                yield event
        except BaseException as exc:
            error = exc
            raise
        finally:
            await events.aclose()
            end_span(span, error)

    def _full_response(self, plan: CompletionPlan, finals: list[Any]) -> CompletionResponse:
        req = plan.request
        n = plan.params.n
        text_of = self._token_text(req)
        choices = []
        num_prompt = num_completion = num_cached = 0
        for pi, (p, final) in enumerate(zip(plan.prompts, finals)):
            num_prompt += len(p.ids)
            num_cached += final.num_cached_tokens
            prompt_text = self._prompt_text(p) if req.echo else ""
            for comp in final.outputs:
                num_completion += len(comp.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    ids, lps = list(comp.token_ids), list(comp.logprobs or [])
                    if req.echo:
                        prompt_lps = final.prompt_logprobs or [None] * len(p.ids)
                        ids, lps = list(p.ids) + ids, list(prompt_lps) + lps
                    logprobs = completion_logprobs(ids, lps, req.logprobs, text_of)
                choices.append(
                    CompletionChoice(
                        index=pi * n + comp.index, text=prompt_text + comp.text, logprobs=logprobs,
                        finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                        prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs) if req.prompt_logprobs is not None else None,
                    )
                )
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=plan.response_id, created=plan.created, model=plan.model, choices=choices,
                                  usage=make_usage(num_prompt, num_completion, num_cached))

    async def _stream(self, plan: CompletionPlan, gens: list) -> AsyncIterator[str]:
        req = plan.request
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        text_of = self._token_text(req)
        n = plan.params.n
        num_prompt = sum(len(p.ids) for p in plan.prompts)
        num_tokens: dict[int, int] = {}
        cached: dict[int, int] = {}
        offsets: dict[int, int] = {}
        echoed: set[int] = set()

        def chunk(choices: list[dict], usage=None) -> str:
            data = {"id": plan.response_id, "object": "text_completion", "created": plan.created, "model": plan.model,
                    "choices": choices}
            if include_usage:
                data["usage"] = usage.model_dump() if usage is not None else None
            return sse(data)

        async def with_first(first, gen):
            yield first
            async for out in gen:
                yield out

        merged = merge([with_first(first, gen) for first, gen in gens])
        try:
            async for pi, out in merged:
                p = plan.prompts[pi]
                cached[pi] = max(cached.get(pi, 0), out.num_cached_tokens)
                for comp in out.outputs:
                    index = pi * n + comp.index
                    num_tokens[index] = num_tokens.get(index, 0) + len(comp.token_ids)
                    text = comp.text
                    ids, lps = list(comp.token_ids), list(comp.logprobs or [])
                    if req.echo and index not in echoed:
                        echoed.add(index)
                        text = self._prompt_text(p) + text
                        ids = list(p.ids) + ids
                        lps = list(out.prompt_logprobs or [None] * len(p.ids)) + lps
                    final = comp.finish_reason is not None
                    if not text and not ids and not final:
                        continue
                    logprobs = None
                    if req.logprobs is not None:
                        lp = completion_logprobs(ids, lps, req.logprobs, text_of, offsets.get(index, 0))
                        offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp.tokens)
                        logprobs = lp.model_dump()
                    choice = {"index": index, "text": text, "logprobs": logprobs,
                              "finish_reason": comp.finish_reason if final else None,
                              "stop_reason": comp.stop_reason if final else None}
                    usage = make_usage(num_prompt, sum(num_tokens.values()), sum(cached.values())) if continuous else None
                    yield chunk([choice], usage)
        finally:
            # closed now, not by the garbage collector: closing each engine iterator
            # aborts its request and releases its output queue (see ChatService._stream)
            await merged.aclose()
            for _, gen in gens:
                await gen.aclose()
        if include_usage:
            yield chunk([], make_usage(num_prompt, sum(num_tokens.values()), sum(cached.values())))
