"""A Responses API request as a chat-completions request, so that `/v1/responses` renders,
constrains and parses through the chat pipeline (serving_chat.py).

Input items, in order, become chat messages:

- a message (`{"role", "content"}`, with or without `"type": "message"`); `developer`
  counts as `system`; content parts `input_text` / `output_text` / `text` / `refusal`
  (text) and `input_image` (an `image_url` part);
- `reasoning` (its `reasoning_text` content), an assistant `message` and `function_call`
  items that follow one another form one assistant turn (`reasoning_content`, `content`,
  `tool_calls`), as a chat model saw them when it wrote them;
- `function_call_output`: a `tool` message answering its `call_id`.

A response's output items are valid input items, so a stored conversation is kept as
items and replayed before the new input for `previous_response_id`. `instructions`
become the system message and are not carried over, as in OpenAI's API.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from portaserve.framework.errors import invalid
from portaserve.framework.server.messages_translate import located
from portaserve.framework.server.protocol import ChatCompletionRequest
from portaserve.framework.server.responses_protocol import ResponsesRequest

#: chat-completions parameter names -> the Responses API's, for errors raised on the chat side
RENAMED = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens", "messages": "input",
           "response_format": "text", "reasoning_effort": "reasoning"}

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def input_items(value: str | list[dict] | None) -> list[dict]:
    """The request's `input` as a list of items (a string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value)


def _content(content: Any, where: str) -> str | list[dict]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise located("input", f"{where}: must be a string or a list of content parts")
    parts: list[dict] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            text = part.get("refusal") if kind == "refusal" else part.get("text")
            if not isinstance(text, str):
                raise located("input", f"{at}.text: must be a string")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise located("input", f"{at}: only images given by image_url (a data: or http(s) URL) are supported")
            parts.append({"type": "image_url", "image_url": {"url": url, "detail": part.get("detail", "auto")}})
        else:
            raise located("input", f"{at}: content parts of type {kind!r} are not supported; supported: "
                                   "'input_text', 'output_text', 'input_image'")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _parts(value: Any) -> list:
    return value if isinstance(value, list) else []


def _reasoning_text(item: dict) -> str:
    texts = [c.get("text", "") for c in _parts(item.get("content")) if isinstance(c, dict)]
    if not texts:  # only a summary was kept
        texts = [s.get("text", "") for s in _parts(item.get("summary")) if isinstance(s, dict)]
    return "".join(t for t in texts if isinstance(t, str))


def items_to_messages(items: list[dict]) -> list[dict]:
    """Chat messages for a list of input items (see the module docstring)."""
    messages: list[dict] = []
    turn: dict | None = None  # the assistant turn being assembled

    def assistant() -> dict:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        return turn

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise located("input", f"{where}: must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise located("input", f"{where}.role: {item.get('role')!r}; allowed: 'user', 'assistant', 'system', "
                                       "'developer'")
            content = _content(item.get("content", ""), f"{where}.content")
            if role == "assistant":
                current = assistant()
                if current["content"] or current.get("tool_calls"):
                    turn = None
                    current = assistant()
                current["content"] = content if isinstance(content, str) else "".join(
                    p.get("text", "") for p in content)
                continue
            turn = None
            messages.append({"role": role, "content": content})
        elif kind == "reasoning":
            if turn is not None and (turn["content"] or turn.get("tool_calls")):
                turn = None
            assistant()["reasoning_content"] = _reasoning_text(item)
        elif kind == "function_call":
            name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, str):
                raise located("input", f"{where}: a function_call needs 'call_id', 'name' and 'arguments' strings")
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise located("input", f"{where}.call_id: must be a string")
            if isinstance(output, list):
                output = _content(output, f"{where}.output")
            if not isinstance(output, str):
                raise located("input", f"{where}.output: must be a string or a list of text parts")
            turn = None
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise located("input", f"{where}: items of type {kind!r} are not supported; supported: 'message', "
                                   "'function_call', 'function_call_output', 'reasoning'")
    return messages


def _tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise located("tools", f"tools[{i}]: the hosted tool {kind!r} is not supported; only function tools "
                                   "(type 'function') run here")
        if not isinstance(tool.get("name"), str):
            raise located("tools", f"tools[{i}].name: must be a string")
        out.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description"),
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}}, "strict": tool.get("strict")}})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("tool_choice", "allowed: 'none', 'auto', 'required' or {'type': 'function', 'name': ...}; hosted "
                                 "tools and allowed_tools are not supported")


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise located("text", "text.format.schema: must be a JSON schema object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    raise located("text", f"text.format.type: {kind!r}; allowed: 'text', 'json_object', 'json_schema'")


def to_chat_request(req: ResponsesRequest, items: list[dict]) -> ChatCompletionRequest:
    """The chat-completions request for `items` (history and new input) under `req`'s settings."""
    messages = items_to_messages(items)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise invalid("input", "holds no messages")
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "tools": _tools(req.tools), "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls, "max_completion_tokens": req.max_output_tokens,
        "response_format": _response_format(req.text), "stream": bool(req.stream),
    }
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["reasoning_effort"] = effort
    for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "stop", "priority",
                 "cache_salt", "disable_any_whitespace"):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise located(RENAMED.get(where.split(".")[0], where.split(".")[0]) or "request", f"{where}: {err.get('msg')}") from None

