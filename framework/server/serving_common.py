"""What every generating route shares: request ids, submitting to the engine (with metrics),
streaming as SSE, aborting on disconnect, logprobs and usage in OpenAI's shapes."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from portaserve.framework.engine.outputs import Logprob, RequestOutput
from portaserve.framework.engine.processor import child_request_id
from portaserve.framework.server.errors import sse_error
from portaserve.framework.server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from portaserve.framework.server.state import ServerState
from portaserve.framework.server.weights_routes import note_weights_version

_engine_ids = itertools.count()


def base_request_id(raw: Request, body_request_id: str | None = None) -> str:
    """The request's id: the body's `request_id`, else X-Request-Id, else a fresh one."""
    if body_request_id:
        return body_request_id
    return getattr(raw.state, "request_id", None) or uuid.uuid4().hex


def engine_request_id(response_id: str) -> str:
    """Unique in the engine even when clients reuse ids."""
    return f"{response_id}-{next(_engine_ids)}"


def random_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


# ----- submitting ---------------------------------------------------------------------------------


async def engine_outputs(
    state: ServerState,
    engine_id: str,
    prompt: Any,
    params: Any,
    *,
    num_prompt_tokens: int,
    priority: int = 0,
    cache_salt: str | None = None,
    lora_request: Any = None,
) -> AsyncIterator[Any]:
    """The engine's outputs for one request, tracked for metrics.

    Closing this iterator (a client gone away, a cancelled handler) closes the engine's,
    which aborts the request and frees its KV blocks.
    """
    engine = state.engine
    metrics = state.metrics
    n = getattr(params, "n", 1)
    if metrics is not None:
        metrics.track(engine_id, n, num_prompt_tokens)
        if lora_request is not None:
            metrics.lora_requests.labels(metrics.model_name, lora_request.lora_name).inc()
    gen = engine.generate(engine_id, prompt, params, priority=priority, cache_salt=cache_salt,
                          **({"lora_request": lora_request} if lora_request is not None else {}))
    try:
        async for out in gen:
            note_weights_version(out)
            if metrics is not None and isinstance(out, RequestOutput):
                for comp in out.outputs:
                    if comp.finish_reason is not None:
                        metrics.finish_child(child_request_id(engine_id, comp.index, n), comp.finish_reason)
            yield out
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except BaseException:
        if metrics is not None:
            metrics.forget(engine_id, n)
        raise
    finally:
        await gen.aclose()


async def prime(gen: AsyncIterator[Any]) -> tuple[Any, AsyncIterator[Any]]:
    """Wait for the first output, so that invalid requests fail before any byte is streamed."""
    try:
        first = await gen.__anext__()
    except BaseException:
        await gen.aclose()
        raise
    return first, gen


async def merge(gens: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several iterators as their items arrive: (iterator index, item)."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[Any]) -> None:
        try:
            async for item in gen:
                await queue.put((i, item))
        except BaseException as exc:  # re-raised in the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            with contextlib.suppress(Exception):
                await g.aclose()


# ----- disconnects --------------------------------------------------------------------------------


async def until_disconnected(raw: Request, work: Awaitable[Response]) -> Response:
    """Run a non-streaming handler, cancelling it (and so aborting its requests) if the client leaves."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return Response(status_code=499)
    return task.result()


class SSEResponse(StreamingResponse):
    """Server-sent events; the body iterator is always closed, so a dropped client aborts its request."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], headers: dict | None = None,
                 on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        """:param on_close: awaited once the response is done, also when the body never
            started (a client gone before the first byte: the generator's own `finally`
            then never runs)."""
        super().__init__(content, media_type=self.media_type, headers={"Cache-Control": "no-cache", **(headers or {})})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                await self.on_close()


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Events, then `[DONE]`; a failure midway becomes an error event (never a traceback)."""
    try:
        async for event in events:
            yield event
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        yield sse_error(exc)
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
    yield SSE_DONE


# ----- logprobs and usage -----------------------------------------------------------------------------


class TokenText:
    """Token strings for logprobs: the decoded token, or `token_id:N` when asked for ids."""

    def __init__(self, tokenizer: Any | None, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids or tokenizer is None

    def __call__(self, token_id: int, lp: Logprob | None = None) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]] | None, top_k: int, text: TokenText
) -> ChatLogprobs | None:
    """OpenAI chat shape: per token {token, logprob, bytes, top_logprobs[top_k]}."""
    if logprobs is None:
        return None
    content = []
    for tid, entry in zip(token_ids, logprobs):
        sampled = entry.get(tid)
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_k), key=lambda x: x[1].rank)
        token = text(tid, sampled)
        content.append(
            TokenLogprob(
                token=token,
                logprob=max(sampled.logprob, -9999.0) if sampled else -9999.0,
                bytes=_utf8(token),
                top_logprobs=[
                    TopLogprob(token=(s := text(t, lp)), logprob=max(lp.logprob, -9999.0), bytes=_utf8(s)) for t, lp in top
                ],
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob] | None],
    top_k: int,
    text: TokenText,
    initial_offset: int = 0,
) -> CompletionLogprobs:
    """OpenAI completions shape: parallel lists; top_logprobs holds the top_k and the sampled token (vLLM)."""
    out = CompletionLogprobs()
    offset = initial_offset
    for tid, entry in zip(token_ids, logprobs):
        if entry is None:  # the first prompt token has no logprob
            token = text(tid)
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            sampled = entry.get(tid)
            token = text(tid, sampled)
            out.tokens.append(token)
            out.token_logprobs.append(max(sampled.logprob, -9999.0) if sampled else None)
            top = {}
            for t, lp in sorted(entry.items(), key=lambda x: x[1].rank if x[1].rank is not None else 1 << 30):
                if t == tid or (lp.rank is not None and lp.rank <= top_k):
                    top[text(t, lp)] = max(lp.logprob, -9999.0)
            out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def prompt_logprobs_json(prompt_logprobs: Sequence[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's `prompt_logprobs` field: per position {token id: {logprob, rank, decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [
        None if entry is None else {tid: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for tid, lp in entry.items()}
        for entry in prompt_logprobs
    ]


def make_usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
    )
