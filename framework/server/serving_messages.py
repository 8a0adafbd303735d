"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API.

The request is translated into a chat-completions request (messages_translate.py) and
planned, submitted and parsed by the chat service: one template rendering, one tool and
reasoning parser stack. Only the output's shape is Anthropic's:

- content blocks in order: `thinking` (the reasoning parser's part), `text`, `tool_use`;
- `stop_reason`: `tool_use` when calls were parsed, `max_tokens` on the length limit,
  `stop_sequence` (with `stop_sequence` set) when a stop string matched, else `end_turn`;
- `usage`: `input_tokens` excludes prefix-cache hits, which are `cache_read_input_tokens`;
- streaming: `message_start`, `content_block_start` / `_delta` (`text_delta`,
  `thinking_delta`, `input_json_delta`) / `_stop`, `message_delta`, `message_stop`, each
  an SSE event named by its type. The deltas come from the same incremental parsers as
  the chat stream, so a stream accumulates to the non-streamed message.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from portaserve.framework.errors import InvalidParameterError
from portaserve.framework.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from portaserve.framework.server.errors import anthropic_error_body, classify
from portaserve.framework.server.messages_translate import RENAMED, renamed_error, to_chat_request
from portaserve.framework.server.parsers import ToolCall
from portaserve.framework.server.serving_chat import ChatPlan, ChatService, ChoiceParser
from portaserve.framework.server.serving_common import SSEResponse, prime, until_disconnected
from portaserve.framework.server.state import ServerState


def sse_event(data: dict) -> str:
    """An SSE event named by its `type` (Anthropic's client reads the event name)."""
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def stop_reason_of(finish_reason: str | None, stop_reason: Any, num_calls: int) -> tuple[str, str | None]:
    """(Anthropic stop_reason, stop_sequence) for the engine's finish."""
    if num_calls:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def tool_input(call: ToolCall) -> Any:
    try:
        return json.loads(call.arguments)
    except ValueError:
        return {}


def usage_of(num_prompt: int, num_cached: int, num_output: int) -> dict:
    return {"input_tokens": num_prompt - num_cached, "output_tokens": num_output,
            "cache_read_input_tokens": num_cached, "cache_creation_input_tokens": 0}


class _Blocks:
    """Streamed content blocks: opens a block when the kind of content changes."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def _start(self, block: dict) -> Iterator[dict]:
        yield from self.close()
        self.index += 1
        self.open = block["type"]
        yield {"type": "content_block_start", "index": self.index, "content_block": block}

    def close(self) -> Iterator[dict]:
        if self.open is not None:
            yield {"type": "content_block_stop", "index": self.index}
            self.open = None

    def text(self, kind: str, text: str) -> Iterator[dict]:
        if self.open != kind:
            yield from self._start({"type": "text", "text": ""} if kind == "text"
                                   else {"type": "thinking", "thinking": "", "signature": ""})
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        yield {"type": "content_block_delta", "index": self.index, "delta": delta}

    def tool_use(self, call: ToolCall) -> Iterator[dict]:
        yield from self._start({"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": {}})
        yield {"type": "content_block_delta", "index": self.index,
               "delta": {"type": "input_json_delta", "partial_json": call.arguments}}
        yield from self.close()


class MessagesService:
    def __init__(self, state: ServerState, chat: ChatService) -> None:
        self.state = state
        self.chat = chat

    async def _plan(self, req: CountTokensRequest, raw: Request) -> ChatPlan:
        try:
            chat_req = to_chat_request(req)
            if not isinstance(req, MessagesRequest) and chat_req.tools:
                # counting only renders: the tools reach the template, nothing is parsed
                chat_req.tool_choice = "none"
            return await self.chat.prepare(chat_req, raw)
        except InvalidParameterError as exc:
            raise renamed_error(exc, RENAMED) from None

    async def count_tokens(self, req: CountTokensRequest, raw: Request) -> Response:
        plan = await self._plan(req, raw)
        return JSONResponse({"input_tokens": len(plan.prompt_ids)})

    async def create(self, req: MessagesRequest, raw: Request) -> Response:
        return await until_disconnected(raw, self._create(req, raw))

    async def _create(self, req: MessagesRequest, raw: Request) -> Response:
        plan = await self._plan(req, raw)
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        if req.max_tokens == 0:  # the API's cache pre-warming: the prompt is checked, nothing generated
            empty = {"id": message_id, "type": "message", "role": "assistant", "model": plan.model, "content": [],
                     "stop_reason": "max_tokens", "stop_sequence": None, "usage": usage_of(len(plan.prompt_ids), 0, 0)}
            if not req.stream:
                return JSONResponse(empty)

            async def events() -> AsyncIterator[str]:
                yield sse_event({"type": "message_start", "message": {**empty, "stop_reason": None}})
                yield sse_event({"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                 "usage": empty["usage"]})
                yield sse_event({"type": "message_stop"})

            return SSEResponse(events())
        first, gen = await prime(self.chat.submit(plan))
        if req.stream:
            return SSEResponse(self._stream(plan, message_id, first, gen), on_close=gen.aclose)
        final = first
        async for out in gen:
            final = out
        return JSONResponse(self._message(plan, message_id, final))

    def _message(self, plan: ChatPlan, message_id: str, final: Any) -> dict:
        comp = final.outputs[0]
        parser = ChoiceParser(self.state, plan, self.state.engine.tokenizer)
        reasoning, content, calls = parser.whole(comp.text)
        blocks: list[dict] = []
        if reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if content:
            blocks.append({"type": "text", "text": content})
        blocks += [{"type": "tool_use", "id": tool_use_id(), "name": c.name, "input": tool_input(c)} for c in calls]
        stop_reason, stop_sequence = stop_reason_of(comp.finish_reason, comp.stop_reason, len(calls))
        return {"id": message_id, "type": "message", "role": "assistant", "model": plan.model, "content": blocks,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": usage_of(len(plan.prompt_ids), final.num_cached_tokens, len(comp.token_ids))}

    async def _stream(self, plan: ChatPlan, message_id: str, first: Any, gen: AsyncIterator[Any]) -> AsyncIterator[str]:
        try:
            async for event in self._events(plan, message_id, first, gen):
                yield sse_event(event)
        except Exception as exc:  # an error event; the client raises it
            status, message, _ = classify(exc)
            yield f"event: error\ndata: {json.dumps(anthropic_error_body(status, message))}\n\n"
        finally:
            await gen.aclose()

    async def _events(self, plan: ChatPlan, message_id: str, first: Any, gen: AsyncIterator[Any]) -> AsyncIterator[dict]:
        num_prompt, num_cached = len(plan.prompt_ids), first.num_cached_tokens
        yield {"type": "message_start", "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": plan.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage_of(num_prompt, num_cached, 0)}}
        parser = ChoiceParser(self.state, plan, self.state.engine.tokenizer)
        blocks = _Blocks()
        num_output, finish, stop = 0, None, None
        out = first
        while out is not None:
            comp = out.outputs[0]
            num_output += len(comp.token_ids)
            final = comp.finish_reason is not None
            reasoning, content, calls = parser.delta(comp.text, final)
            if reasoning:
                for event in blocks.text("thinking", reasoning):
                    yield event
            if content:
                for event in blocks.text("text", content):
                    yield event
            for call in calls:
                for event in blocks.tool_use(call):
                    yield event
            if final:
                finish, stop = comp.finish_reason, comp.stop_reason
            out = await anext(gen, None)
        for event in blocks.close():
            yield event
        stop_reason, stop_sequence = stop_reason_of(finish, stop, parser.num_calls)
        yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
               "usage": usage_of(num_prompt, num_cached, num_output)}
        yield {"type": "message_stop"}
