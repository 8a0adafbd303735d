"""`/v1/chat/completions`: render the conversation, generate, parse reasoning and tool calls.

`tool_choice`:
- `"none"` (the default without tools): no parsing; the tools still reach the template,
  as in vLLM;
- `"auto"` (the default with tools): needs `--enable-auto-tool-choice` and
  `--tool-call-parser`; calls the parser finds are returned as `tool_calls`, with
  finish_reason `"tool_calls"`;
- `"required"` and a named function: enforced while sampling (tool_constraints.py): the
  output is constrained to JSON calls of the tools (to the named function's arguments),
  returned as `tool_calls` with finish_reason `"tool_calls"`; no parser is needed.

`parallel_tool_calls: false` keeps the first call only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from portaserve.framework.engine.params import RequestOutputKind, SamplingParams
from portaserve.framework.engine.chat import chat_image_urls
from portaserve.framework.errors import invalid
from portaserve.framework.multimodal.media import load_image
from portaserve.framework.server.parsers import ReasoningParser, ToolCall, ToolParser
from portaserve.framework.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    NamedToolChoice,
    ToolCallFunction,
    ToolCallOut,
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
    random_tool_call_id,
    sse,
    sse_stream,
    until_disconnected,
)
from portaserve.framework.server.state import ServerState
from portaserve.framework.server.tool_constraints import calls_from_output, tool_constraint
from portaserve.framework.server.tracing import end_span


@dataclass(slots=True)
class ChatPlan:
    """A validated chat request, ready for the engine."""

    request: ChatCompletionRequest
    model: str
    response_id: str
    engine_id: str
    prompt_text: str
    prompt_ids: list[int]
    params: SamplingParams
    tool_choice: Any
    forced_tool: str | None
    echo_text: str
    #: the images (MultiModalFeatures), placeholders already expanded in prompt_ids
    mm_features: tuple = ()
    #: the LoRA adapter the request's `model` names, None for the base model
    lora_request: Any = None
    created: int = field(default_factory=lambda: int(time.time()))


def chat_images(state: ServerState, engine: Any, refs: list[tuple[str, str]], prompt_ids: list[int]):
    """Load a conversation's images under the server's media policy and expand their
    placeholders: (prompt ids, features). Errors name the content part."""
    processor = engine.processor
    mm = processor.mm_processor
    if mm is None:
        raise invalid("messages", f"{refs[0][1]}: this model does not take images (it is not a vision-language model)")
    limit = processor.image_limit
    if len(refs) > limit:
        raise invalid("messages", f"{len(refs)} images exceed the limit of {limit} per prompt (--limit-mm-per-prompt)")
    found = sum(1 for t in prompt_ids if t == mm.placeholder_token_id)
    if found != len(refs):
        raise invalid("messages", f"the chat template placed {found} image placeholder(s) for {len(refs)} "
                      "image part(s); it does not render image parts for this model")
    policy = state.media_policy()
    images = [load_image(url, policy, where) for url, where in refs]
    ids, features = mm.expand(prompt_ids, images, param="messages")
    return ids, tuple(features)


class ChoiceParser:
    """One choice's reasoning + tool parsing, for a whole text or a stream of deltas."""

    def __init__(self, state: ServerState, plan: ChatPlan, tokenizer: Any) -> None:
        req = plan.request
        self.reasoning: ReasoningParser | None = None
        self.tools: ToolParser | None = None
        self.include_reasoning = req.include_reasoning
        if state.reasoning_parser_cls is not None:
            self.reasoning = state.reasoning_parser_cls(tokenizer, prompt=plan.prompt_text)
        # a forced choice ("required", a named function) was constrained to calls: in the tool
        # parser's format (read by the parser), or to vLLM's JSON without one (parsed here)
        forced = plan.tool_choice == "required" or plan.forced_tool is not None
        parser_format = getattr(state.tool_parser_cls, "call_format", None)
        self.constrained = plan.tool_choice if forced and parser_format is None else None
        if state.tool_parser_cls is not None and req.tools and plan.tool_choice != "none" and self.constrained is None:
            self.tools = state.tool_parser_cls(tokenizer, tools=[t.model_dump(exclude_none=True) for t in req.tools])
        self.forced_tool = plan.forced_tool
        self.parallel = req.parallel_tool_calls is not False
        self.num_calls = 0

    def _keep(self, calls: list[ToolCall] | tuple[ToolCall, ...]) -> list[ToolCall]:
        kept = []
        for call in calls:
            if self.forced_tool is not None and call.name != self.forced_tool:
                continue
            if not self.parallel and self.num_calls >= 1:
                continue
            self.num_calls += 1
            kept.append(call)
        return kept

    def whole(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.extract(text)
        calls: list[ToolCall] = []
        if self.constrained is not None:
            calls = self._keep(calls_from_output(content or "", self.constrained))
            return (reasoning if self.include_reasoning else None), (None if calls else content or None), calls
        if self.tools is not None and content is not None:
            content, found = self.tools.extract(content)
            calls = self._keep(found)
        return (reasoning if self.include_reasoning else None), (content or None), calls

    def delta(self, text: str, final: bool) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = "", text
        if self.reasoning is not None:
            d = self.reasoning.feed(text)
            reasoning, content = d.reasoning, d.content
            if final:
                end = self.reasoning.finish()
                reasoning, content = reasoning + end.reasoning, content + end.content
        calls: list[ToolCall] = []
        if self.constrained is not None:  # the calls come whole, with the last delta
            self._held = getattr(self, "_held", "") + content
            if not final:
                return (reasoning if self.include_reasoning else ""), "", []
            calls = self._keep(calls_from_output(self._held, self.constrained))
            return (reasoning if self.include_reasoning else ""), ("" if calls else self._held), calls
        if self.tools is not None:
            d = self.tools.feed(content)
            content, found = d.content, list(d.tool_calls)
            if final:
                end = self.tools.finish()
                content += end.content
                found += end.tool_calls
            calls = self._keep(found)
        return (reasoning if self.include_reasoning else ""), content, calls


def _tool_call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=random_tool_call_id(), function=ToolCallFunction(name=call.name, arguments=call.arguments))


class ChatService:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    # ----- validation and rendering ----------------------------------------------------------------

    def plan(self, req: ChatCompletionRequest, raw: Request) -> ChatPlan:
        state, settings = self.state, self.state.settings
        engine = state.require_engine()
        model = state.check_model(req.model)
        req.unsupported_fields()
        limits = settings.limits
        limits.check_chat(req)
        limits.check_sampling(req)
        limits.check_truncate(req.truncate_prompt_tokens, state.spec.max_model_len)
        state.check_priority(req.priority)
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise invalid("messages", "this server was started without a tokenizer; use /inference/v1/generate with token ids")
        tool_choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        forced = None
        if tool_choice != "none" and not req.tools:
            raise invalid("tool_choice", "needs tools")
        if tool_choice == "auto" and not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise invalid("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        if isinstance(tool_choice, NamedToolChoice):
            forced = tool_choice.function.name
            names = [t.function.name for t in req.tools or ()]
            if forced not in names:
                raise invalid("tool_choice", f"names the function {forced!r}, which is not in tools ({', '.join(names)})")
        constrained = tool_choice == "required" or isinstance(tool_choice, NamedToolChoice)
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        if req.documents is not None:
            kwargs.setdefault("documents", req.documents)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        prompt_text = state.render_chat(
            tokenizer,
            req.messages,
            request_template=req.chat_template,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=tools,
            chat_template_kwargs=kwargs,
        )
        prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=req.add_special_tokens)
        features: tuple = ()
        image_refs = chat_image_urls(req.messages)
        if image_refs:
            prompt_ids, features = chat_images(state, engine, image_refs, prompt_ids)
        if req.truncate_prompt_tokens is not None:
            if features:
                raise invalid("truncate_prompt_tokens", "cannot truncate a prompt with images")
            prompt_ids = prompt_ids[-req.truncate_prompt_tokens:]
        limits.check_prompt_logprobs(req.prompt_logprobs, len(prompt_ids))
        kwargs = req.sampling_kwargs()
        if constrained:
            if kwargs.get("structured_outputs") is not None:
                raise invalid("tool_choice", f"a forced tool call cannot be combined with "
                                             f"{kwargs['structured_outputs'].field_name}")
            parser_format = getattr(state.tool_parser_cls, "call_format", None)
            kwargs["structured_outputs"] = tool_constraint(req.tools, tool_choice, req.parallel_tool_calls is not False,
                                                           req.disable_any_whitespace, parser_format)
        so = kwargs.get("structured_outputs")
        parser = state.reasoning_parser_cls
        if so is not None and parser is not None and not prompt_text.rstrip().endswith(parser.end_token):
            # a reasoning model: constrained from after its reasoning, found in the engine by these ids
            so.reasoning_end = tokenizer.encode(parser.end_token, add_special_tokens=False)
        params = SamplingParams(
            **kwargs,
            max_tokens=req.max_output_tokens,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
        )
        echo_text = ""
        if req.echo and req.messages and req.messages[-1].get("role") == settings.response_role:
            content = req.messages[-1].get("content")
            echo_text = content if isinstance(content, str) else ""
        response_id = f"chatcmpl-{base_request_id(raw, req.request_id)}"
        return ChatPlan(req, model, response_id, engine_request_id(response_id), prompt_text, prompt_ids, params,
                        tool_choice, forced, echo_text, features, state.lora_for(model))

    # ----- the route -----------------------------------------------------------------------------------

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        return await until_disconnected(raw, self._create(req, raw))

    async def prepare(self, req: ChatCompletionRequest, raw: Request) -> ChatPlan:
        """`plan`, off the event loop where it may take long: a request's own template
        renders in another process (up to --chat-template-timeout), images are fetched,
        decoded and preprocessed."""
        if req.chat_template is not None or chat_image_urls(req.messages):
            return await asyncio.to_thread(self.plan, req, raw)
        return self.plan(req, raw)

    def submit(self, plan: ChatPlan) -> AsyncIterator[Any]:
        """The engine's outputs for `plan` (closing the iterator aborts the request)."""
        return engine_outputs(
            self.state, plan.engine_id,
            {"prompt": plan.prompt_text, "prompt_token_ids": plan.prompt_ids, "multi_modal_features": plan.mm_features},
            plan.params,
            num_prompt_tokens=len(plan.prompt_ids), priority=plan.request.priority, cache_salt=plan.request.cache_salt,
            lora_request=plan.lora_request,
        )

    async def _create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        plan = await self.prepare(req, raw)
        state = self.state
        span = state.tracer.start(
            "chat.completions", raw.headers, **{
                "gen_ai.request.id": plan.response_id, "gen_ai.request.model": plan.model,
                "gen_ai.request.max_tokens": plan.params.max_tokens, "gen_ai.request.temperature": plan.params.temperature,
                "gen_ai.request.top_p": plan.params.top_p, "gen_ai.request.n": plan.params.n,
                "gen_ai.usage.prompt_tokens": len(plan.prompt_ids),
            },
        )
        gen = self.submit(plan)
        try:
            first, gen = await prime(gen)
            if req.stream:
                return SSEResponse(sse_stream(self._stream(plan, first, gen, span)))
            final = first
            async for out in gen:
                final = out
            body = self._full_response(plan, final)
        except BaseException as exc:
            end_span(span, exc)
            raise
        end_span(span, **{"gen_ai.usage.completion_tokens": body.usage.completion_tokens,
                          "gen_ai.response.finish_reasons": [c.finish_reason or "" for c in body.choices]})
        return JSONResponse(body.model_dump(mode="json"))

    def _token_text(self, req: ChatCompletionRequest) -> TokenText:
        as_ids = req.return_tokens_as_token_ids if req.return_tokens_as_token_ids is not None else self.state.settings.return_tokens_as_token_ids
        return TokenText(self.state.engine.tokenizer, bool(as_ids))

    def _finish_reason(self, plan: ChatPlan, reason: str | None, num_calls: int) -> str | None:
        if reason is not None and num_calls and plan.tool_choice != "none":
            return "tool_calls"
        return reason

    def _full_response(self, plan: ChatPlan, final: Any) -> ChatCompletionResponse:
        req = plan.request
        text_of = self._token_text(req)
        choices = []
        for comp in final.outputs:
            parser = ChoiceParser(self.state, plan, self.state.engine.tokenizer)
            reasoning, content, calls = parser.whole(plan.echo_text + comp.text)
            message = ChatMessage(
                role=self.state.settings.response_role,
                content=content,
                reasoning_content=reasoning,
                tool_calls=[_tool_call_out(c) for c in calls],
            )
            logprobs = chat_logprobs(comp.token_ids, comp.logprobs, req.top_logprobs or 0, text_of) if req.logprobs else None
            choices.append(
                ChatChoice(
                    index=comp.index, message=message, logprobs=logprobs,
                    finish_reason=self._finish_reason(plan, comp.finish_reason, len(calls)), stop_reason=comp.stop_reason,
                )
            )
        usage = make_usage(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs), final.num_cached_tokens)
        return ChatCompletionResponse(
            id=plan.response_id, created=plan.created, model=plan.model, choices=choices, usage=usage,
            prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs),
        )

    async def _stream(self, plan: ChatPlan, first: Any, gen: AsyncIterator[Any], span: Any = None) -> AsyncIterator[str]:
        counts: list[int] = []
        error = None
        events = self._stream_events(plan, first, gen, counts)
        try:
            async for event in events:
                yield event
        except BaseException as exc:
            error = exc
            raise
        finally:
            # Close both now, not when the garbage collector gets to them: closing `gen`
            # aborts the request and releases its output queue. A suspended generator
            # left to the collector (a cycle through a traceback) kept a dropped stream's
            # request in flight for an unbounded time.
            await events.aclose()
            await gen.aclose()
            end_span(span, error, **{"gen_ai.usage.completion_tokens": sum(counts)})

    async def _stream_events(self, plan: ChatPlan, first: Any, gen: AsyncIterator[Any], counts: list[int]) -> AsyncIterator[str]:
        req = plan.request
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        text_of = self._token_text(req)
        n = plan.params.n
        parsers = [ChoiceParser(self.state, plan, self.state.engine.tokenizer) for _ in range(n)]
        num_tokens = counts
        num_tokens.extend([0] * n)
        num_calls = [0] * n
        num_prompt = len(plan.prompt_ids)
        num_cached = 0
        role = self.state.settings.response_role

        def chunk(choices: list[dict], usage: Any = None) -> str:
            data = {"id": plan.response_id, "object": "chat.completion.chunk", "created": plan.created,
                    "model": plan.model, "choices": choices}
            if include_usage:
                data["usage"] = usage.model_dump() if usage is not None else None
            return sse(data)

        def running_usage():
            return make_usage(num_prompt, sum(num_tokens), num_cached) if continuous else None

        for i in range(n):
            delta: dict[str, Any] = {"role": role, "content": ""}
            yield chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}], running_usage())
        echo_pending = [plan.echo_text] * n

        async def outputs():
            yield first
            async for out in gen:
                yield out

        async for out in outputs():
            num_cached = max(num_cached, out.num_cached_tokens)
            for comp in out.outputs:
                i = comp.index
                num_tokens[i] += len(comp.token_ids)
                final = comp.finish_reason is not None
                text = echo_pending[i] + comp.text
                echo_pending[i] = ""
                reasoning, content, calls = parsers[i].delta(text, final)
                delta: dict[str, Any] = {}
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if content:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = [
                        {"index": num_calls[i] + k, "id": random_tool_call_id(), "type": "function",
                         "function": {"name": c.name, "arguments": c.arguments}}
                        for k, c in enumerate(calls)
                    ]
                    num_calls[i] += len(calls)
                logprobs = None
                if req.logprobs and comp.token_ids:
                    lp = chat_logprobs(comp.token_ids, comp.logprobs, req.top_logprobs or 0, text_of)
                    logprobs = lp.model_dump() if lp is not None else None
                if not delta and logprobs is None and not final:
                    continue
                choice: dict[str, Any] = {
                    "index": i, "delta": delta, "logprobs": logprobs,
                    "finish_reason": self._finish_reason(plan, comp.finish_reason, num_calls[i]) if final else None,
                }
                if final:
                    choice["stop_reason"] = comp.stop_reason
                yield chunk([choice], running_usage())
        if include_usage:
            yield chunk([], make_usage(num_prompt, sum(num_tokens), num_cached))
