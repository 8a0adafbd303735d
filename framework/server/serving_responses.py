"""`/v1/responses`: OpenAI's Responses API, over the chat pipeline.

`POST /v1/responses` translates its input items (and, with `previous_response_id`, the
stored conversation before them) into a chat-completions request (responses_translate.py),
which the chat service plans, submits and parses. The output becomes items, in order:
`reasoning` (the reasoning parser's part), `message` (`output_text`), `function_call`s.

- `status`: `completed`; `incomplete` (`incomplete_details.reason: max_output_tokens`) on
  the length limit; `cancelled` after `POST /v1/responses/{id}/cancel`.
- `store` (default true) keeps the response and its conversation (response_store.py) for
  `GET` / `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` and
  `previous_response_id`, visible only to the API key that created it.
- Streaming sends typed events, each an SSE event named by its `type` and numbered by
  `sequence_number`: `response.created`, `response.in_progress`, per item
  `response.output_item.added`, `response.content_part.added`, the deltas
  (`response.output_text.delta`, `response.reasoning_text.delta`,
  `response.function_call_arguments.delta`), their `.done` events,
  `response.output_item.done`, then `response.completed` (or `response.incomplete`). The
  deltas come from the chat stream's incremental parsers, so they accumulate to the
  non-streamed output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from portaserve.framework.engine.params import RequestOutputKind
from portaserve.framework.errors import InvalidParameterError, invalid
from portaserve.framework.server.errors import APIError, classify
from portaserve.framework.server.messages_translate import renamed_error
from portaserve.framework.server.parsers import ToolCall
from portaserve.framework.server.response_store import ResponseStore, StoredResponse
from portaserve.framework.server.responses_protocol import ResponsesRequest
from portaserve.framework.server.responses_translate import RENAMED, input_items, to_chat_request
from portaserve.framework.server.serving_chat import ChatPlan, ChatService, ChoiceParser
from portaserve.framework.server.serving_common import SSEResponse, prime, until_disconnected
from portaserve.framework.server.state import ServerState


_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"id": item_id or _id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict:
    return {"id": item_id or _id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call: ToolCall, item_id: str | None = None, arguments: str | None = None, status: str = "completed") -> dict:
    return {"id": item_id or _id("fc"), "type": "function_call", "call_id": _id("call"), "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


class _Run:
    """One response being made: its settings and what it has produced so far."""

    def __init__(self, req: ResponsesRequest, plan: ChatPlan, caller: str, history: list[dict], new: list[dict]) -> None:
        self.req, self.plan, self.caller = req, plan, caller
        self.id = _id("resp")
        self.created_at = int(time.time())
        new = [item if item.get("id") else {**item, "id": _id(_ITEM_PREFIX.get(item.get("type", "message"), "item"))}
               for item in new]
        self.items = history + new  # the conversation so far, as input items, with ids
        self.num_output = 0
        self.num_cached = 0
        self.finish_reason: str | None = None
        self.cancelled = asyncio.Event()
        self.done = asyncio.get_running_loop().create_future()

    def status(self) -> tuple[str, dict | None]:
        if self.cancelled.is_set() and self.finish_reason is None:
            return "cancelled", None
        if self.finish_reason == "length":
            return "incomplete", {"reason": "max_output_tokens"}
        return "completed", None

    def response(self, status: str, output: list[dict], incomplete: dict | None = None, error: dict | None = None) -> dict:
        req, num_prompt = self.req, len(self.plan.prompt_ids)
        usage = None
        if status != "in_progress":
            usage = {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": self.num_cached},
                     "output_tokens": self.num_output, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": num_prompt + self.num_output}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": error,
            "incomplete_details": incomplete, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.plan.model, "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning or {"effort": None, "summary": None}, "store": req.store is not False,
            "temperature": req.temperature, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": req.top_p,
            "truncation": "disabled", "usage": usage, "metadata": req.metadata or {}, "user": req.user,
        }


class _EventStream:
    """Typed stream events with sequence numbers, and the output items they build."""

    def __init__(self, run: _Run) -> None:
        self.run = run
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item being streamed
        self.text = ""

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def close(self) -> list[str]:
        item = self.open
        if item is None:
            return []
        where, text = self._where(), self.text
        if item["type"] == "reasoning":
            final = reasoning_item(text, item["id"])
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=text)]
        else:
            final = message_item(text, item["id"], "incomplete" if self.run.finish_reason == "length" else "completed")
            events = [self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])]
        events += [self.event("response.content_part.done", **where, content_index=0, part=final["content"][0]),
                   self.event("response.output_item.done", output_index=len(self.output), item=final)]
        self.output.append(final)
        self.open, self.text = None, ""
        return events

    def delta(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        if self.open is None or self.open["type"] != kind:
            events += self.close()
            if kind == "reasoning":
                self.open = reasoning_item("", status="in_progress")
                self.open["content"] = []
                part = {"type": "reasoning_text", "text": ""}
            else:
                self.open = message_item("", status="in_progress")
                self.open["content"] = []
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += [self.event("response.output_item.added", output_index=len(self.output), item=self.open),
                       self.event("response.content_part.added", **self._where(), content_index=0, part=part)]
        self.text += text
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text))
        else:
            events.append(self.event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                     logprobs=[]))
        return events

    def call(self, call: ToolCall) -> list[str]:
        events = self.close()
        index = len(self.output)
        started = call_item(call, arguments="", status="in_progress")
        final = dict(started, arguments=call.arguments, status="completed")
        where = {"item_id": started["id"], "output_index": index}
        events += [self.event("response.output_item.added", output_index=index, item=started),
                   self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
                   self.event("response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments),
                   self.event("response.output_item.done", output_index=index, item=final)]
        self.output.append(final)
        return events


async def _until_cancelled(first: Any, gen: AsyncIterator[Any], cancelled: asyncio.Event) -> AsyncIterator[Any]:
    """The engine's outputs until the last one, or until `cancelled` is set (the request
    is then aborted: closing `gen` aborts it)."""
    yield first
    while not first.finished:
        step = asyncio.ensure_future(anext(gen, None))
        stop = asyncio.ensure_future(cancelled.wait())
        try:
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this task is cancelled (a client gone): `gen` must not be left running
            stop.cancel()
            if not step.done():
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await step
        if step.cancelled():
            return
        out = step.result()
        if out is None:
            return
        yield out
        if out.finished:
            return


class ResponsesService:
    def __init__(self, state: ServerState, chat: ChatService, store: ResponseStore) -> None:
        self.state = state
        self.chat = chat
        self.store = store
        self.in_flight: dict[str, _Run] = {}

    # ----- creating ------------------------------------------------------------------------------

    async def _start(self, req: ResponsesRequest, raw: Request) -> _Run:
        req.unsupported_fields()
        caller = getattr(raw.state, "caller", "")
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous = self.store.get(caller, req.previous_response_id)
            if previous is None:
                raise APIError(404, f"previous_response_id: no stored response {req.previous_response_id!r}",
                               "previous_response_id")
            history = previous.items
        new = input_items(req.input)
        try:
            plan = await self.chat.prepare(to_chat_request(req, history + new), raw)
        except InvalidParameterError as exc:
            raise renamed_error(exc, RENAMED) from None
        return _Run(req, plan, caller, history, new)

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        return await until_disconnected(raw, self._create(req, raw))

    async def _create(self, req: ResponsesRequest, raw: Request) -> Response:
        run = await self._start(req, raw)
        # deltas, streamed or not: a response cancelled midway keeps what it has written
        run.plan.params.output_kind = RequestOutputKind.DELTA
        self.in_flight[run.id] = run
        try:
            first, gen = await prime(self.chat.submit(run.plan))
        except BaseException:
            self._release(run)
            raise
        if req.stream:
            async def close() -> None:
                await gen.aclose()
                self._release(run)

            return SSEResponse(self._stream(run, first, gen), on_close=close)
        try:
            text = []
            async for out in _until_cancelled(first, gen, run.cancelled):
                self._count(run, out)
                text.append(out.outputs[0].text)
            body = self._finish(run, self._output(run, "".join(text)))
        finally:
            await gen.aclose()
            self._release(run)
        return JSONResponse(body)

    def _count(self, run: _Run, out: Any) -> None:
        comp = out.outputs[0]
        run.num_cached = max(run.num_cached, out.num_cached_tokens)
        run.num_output += len(comp.token_ids)
        if comp.finish_reason is not None and comp.finish_reason != "abort":
            run.finish_reason = comp.finish_reason

    def _output(self, run: _Run, text: str) -> list[dict]:
        reasoning, content, calls = ChoiceParser(self.state, run.plan, self.state.engine.tokenizer).whole(text)
        status, _ = run.status()
        output = [reasoning_item(reasoning)] if reasoning else []
        if content:
            output.append(message_item(content, status="incomplete" if status == "incomplete" else "completed"))
        return output + [call_item(c) for c in calls]

    def _finish(self, run: _Run, output: list[dict]) -> dict:
        status, incomplete = run.status()
        body = run.response(status, output, incomplete)
        if run.req.store is not False:
            self.store.put(run.caller, run.id, StoredResponse(body, run.items + output))
        return body

    def _release(self, run: _Run) -> None:
        self.in_flight.pop(run.id, None)
        if not run.done.done():
            run.done.set_result(None)

    async def _stream(self, run: _Run, first: Any, gen: AsyncIterator[Any]) -> AsyncIterator[str]:
        events = _EventStream(run)
        try:
            created = run.response("in_progress", [])
            yield events.event("response.created", response=created)
            yield events.event("response.in_progress", response=created)
            parser = ChoiceParser(self.state, run.plan, self.state.engine.tokenizer)
            async for out in _until_cancelled(first, gen, run.cancelled):
                self._count(run, out)
                comp = out.outputs[0]
                reasoning, content, calls = parser.delta(comp.text, comp.finish_reason is not None)
                for chunk in ((events.delta("reasoning", reasoning) if reasoning else []) +
                              (events.delta("message", content) if content else [])):
                    yield chunk
                for call in calls:
                    for chunk in events.call(call):
                        yield chunk
            for chunk in events.close():
                yield chunk
            body = self._finish(run, events.output)
            kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
            yield events.event(kind, response=body)
        except Exception as exc:  # an error event; the client raises it
            status, message, param = classify(exc)
            yield events.event("error", code=str(status), message=message, param=param)
        finally:
            await gen.aclose()
            self._release(run)

    # ----- stored responses ----------------------------------------------------------------------

    def _stored(self, raw: Request, response_id: str) -> StoredResponse:
        found = self.store.get(getattr(raw.state, "caller", ""), response_id)
        if found is None:
            raise APIError(404, f"no stored response {response_id!r}", "response_id")
        return found

    def _running(self, raw: Request, response_id: str) -> _Run | None:
        run = self.in_flight.get(response_id)
        return run if run is not None and run.caller == getattr(raw.state, "caller", "") else None

    async def retrieve(self, response_id: str, raw: Request) -> Response:
        run = self._running(raw, response_id)
        if run is not None:
            return JSONResponse(run.response("in_progress", []))
        return JSONResponse(self._stored(raw, response_id).response)

    async def input_items(self, response_id: str, raw: Request) -> Response:
        record = self._stored(raw, response_id)
        items = record.items[:len(record.items) - len(record.response.get("output") or ())]
        return JSONResponse({"object": "list", "data": items, "has_more": False,
                             "first_id": (items[0].get("id") if items else None),
                             "last_id": (items[-1].get("id") if items else None)})

    async def delete(self, response_id: str, raw: Request) -> Response:
        if not self.store.delete(getattr(raw.state, "caller", ""), response_id):
            raise APIError(404, f"no stored response {response_id!r}", "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, response_id: str, raw: Request) -> Response:
        run = self._running(raw, response_id)
        if run is None:
            self._stored(raw, response_id)  # 404 when unknown
            raise invalid("response_id", f"{response_id!r} has finished; only a response in progress can be cancelled")
        run.cancelled.set()
        await asyncio.shield(run.done)
        found = self.store.get(run.caller, response_id)
        return JSONResponse(found.response if found is not None else run.response("cancelled", []))
