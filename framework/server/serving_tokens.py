"""Token routes: `/tokenize`, `/detokenize`, and the native `/inference/v1/generate`
(token ids and SamplingParams in, token ids and logprobs out, streamed or not) for
RL trainers and disaggregated callers that do their own text processing."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from portaserve.framework.engine.params import RequestOutputKind, SamplingParams
from portaserve.framework.errors import invalid
from portaserve.framework.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from portaserve.framework.server.serving_common import (
    SSEResponse,
    TokenText,
    base_request_id,
    chat_logprobs,
    engine_outputs,
    engine_request_id,
    make_usage,
    prime,
    prompt_logprobs_json,
    sse,
    sse_stream,
    until_disconnected,
)
from portaserve.framework.server.state import ServerState


class TokenService:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _tokenizer(self):
        tok = self.state.require_engine().tokenizer
        if tok is None:
            raise invalid("tokenizer", "this server was started without a tokenizer (--skip-tokenizer-init)")
        return tok

    # ----- /tokenize, /detokenize -----------------------------------------------------------------

    async def tokenize(self, req: TokenizeRequest) -> Response:
        state = self.state
        tok = self._tokenizer()
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise invalid("prompt", "give exactly one of prompt (text) and messages (a conversation)")
        if req.messages is not None:
            state.settings.limits.check_chat(req)
            render = functools.partial(
                state.render_chat, tok, req.messages, request_template=req.chat_template,
                add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
                tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
                chat_template_kwargs=req.chat_template_kwargs,
            )
            text = await asyncio.to_thread(render) if req.chat_template is not None else render()
            ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        body = TokenizeResponse(count=len(ids), max_model_len=state.spec.max_model_len, tokens=ids, token_strs=strs)
        return JSONResponse(body.model_dump(mode="json"))

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        state = self.state
        tok = self._tokenizer()
        state.check_model(req.model)
        state.settings.limits.check_token_ids("tokens", req.tokens)
        vocab = state.spec.vocab_size if state.spec is not None else tok.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise invalid("tokens", f"{bad[:5]} are outside the vocabulary [0, {vocab})")
        return JSONResponse(DetokenizeResponse(prompt=tok.decode(req.tokens, skip_special_tokens=False)).model_dump())

    # ----- /inference/v1/generate ---------------------------------------------------------------------

    async def generate(self, req: GenerateRequest, raw: Request) -> Response:
        return await until_disconnected(raw, self._generate(req, raw))

    async def _generate(self, req: GenerateRequest, raw: Request) -> Response:
        state = self.state
        state.require_engine()
        lora = state.lora_for(state.check_model(req.model))
        state.check_priority(req.priority)
        req.check_sampling_fields()
        if req.stream_options is not None and not req.stream:
            raise invalid("stream_options", "is only allowed when stream is true")
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        limits = state.settings.limits
        limits.check_token_ids("token_ids", req.token_ids)
        try:
            params = SamplingParams(**req.sampling_params, output_kind=kind)
        except TypeError as exc:
            raise invalid("sampling_params", str(exc)) from None
        limits.check_sampling(params)
        limits.check_prompt_logprobs(params.prompt_logprobs, len(req.token_ids))
        request_id = base_request_id(raw, req.request_id)
        gen = engine_outputs(
            state, engine_request_id(request_id), {"prompt_token_ids": list(req.token_ids)}, params,
            num_prompt_tokens=len(req.token_ids), priority=req.priority, cache_salt=req.cache_salt, lora_request=lora,
        )
        first, gen = await prime(gen)
        text_of = TokenText(None, True)
        top_k = params.logprobs or 0
        if req.stream:
            return SSEResponse(sse_stream(self._stream(req, request_id, first, gen, text_of, top_k)))
        final = first
        async for out in gen:
            final = out
        choices = [
            GenerateChoice(
                index=c.index, token_ids=list(c.token_ids), finish_reason=c.finish_reason,
                logprobs=chat_logprobs(c.token_ids, c.logprobs, top_k, text_of) if params.logprobs is not None else None,
            )
            for c in final.outputs
        ]
        body = GenerateResponse(
            request_id=request_id, choices=choices, prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs),
            usage=make_usage(len(req.token_ids), sum(len(c.token_ids) for c in final.outputs), final.num_cached_tokens),
        )
        return JSONResponse(body.model_dump(mode="json"))

    async def _stream(self, req: GenerateRequest, request_id: str, first: Any, gen: AsyncIterator[Any],
                      text_of: TokenText, top_k: int) -> AsyncIterator[str]:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        num_tokens = 0
        num_cached = 0
        want_logprobs = req.sampling_params.get("logprobs") is not None

        async def outputs():
            yield first
            async for out in gen:
                yield out

        async for out in outputs():
            num_cached = max(num_cached, out.num_cached_tokens)
            choices = []
            for c in out.outputs:
                num_tokens += len(c.token_ids)
                lp = chat_logprobs(c.token_ids, c.logprobs, top_k, text_of) if want_logprobs else None
                choices.append({"index": c.index, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                                "logprobs": lp.model_dump() if lp is not None else None})
            data: dict[str, Any] = {"request_id": request_id, "choices": choices}
            if out.prompt_logprobs is not None:
                data["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
            yield sse(data)
        if include_usage:
            yield sse({"request_id": request_id, "choices": [],
                       "usage": make_usage(len(req.token_ids), num_tokens, num_cached).model_dump()})
