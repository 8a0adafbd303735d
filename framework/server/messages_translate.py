"""An Anthropic Messages request as a chat-completions request, so that `/v1/messages` renders,
constrains and parses through the same pipeline as `/v1/chat/completions` (serving_chat.py).

- `system` (a string or text blocks) becomes the first, system, message;
- user blocks: `text`, `image` (base64 or url source, as an `image_url` part),
  `tool_result` (a `tool` message answering its `tool_use_id`, placed before the user's
  other blocks of that turn, as the API orders them);
- assistant blocks: `text`, `tool_use` (a tool call, its `input` as JSON arguments),
  `thinking` (the message's `reasoning_content`); `redacted_thinking` is dropped;
- `tools` with `input_schema`; `tool_choice` `auto` / `any` (required) / `tool` (a named
  function) / `none`; `disable_parallel_tool_use`;
- `thinking` sets the template's `enable_thinking`; the reasoning parser
  (`--reasoning-parser`) splits the output into `thinking` and `text` blocks;
- `output_config`: `effort` is the template's `reasoning_effort`, `format` a JSON schema
  the output is constrained to (structured outputs).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from portaserve.framework.errors import InvalidParameterError, invalid
from portaserve.framework.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from portaserve.framework.server.protocol import ChatCompletionRequest

#: chat-completions parameter names -> the Messages API's, for errors raised on the chat side
RENAMED = {"max_completion_tokens": "max_tokens", "max_tokens": "max_tokens", "stop": "stop_sequences",
           "response_format": "output_config", "reasoning_effort": "output_config"}

_IGNORED_BLOCK_KEYS = ("cache_control", "citations")


def located(param: str, message: str) -> InvalidParameterError:
    """An error whose message already starts with where it is (`messages[2].content[0]: ...`)."""
    return InvalidParameterError(param, message)


def renamed_error(exc: InvalidParameterError, names: dict[str, str]) -> InvalidParameterError:
    """The same error naming the client's parameter (`stop` -> `stop_sequences`)."""
    new = names.get(exc.param or "")
    if new is None or new == exc.param:
        return exc
    message = str(exc)
    if message.startswith(f"{exc.param}:"):
        message = new + message[len(exc.param):]
    return InvalidParameterError(new, message)


def _text_of(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise located("messages", f"{where}.text: must be a string")
    return text


def system_text(system: Any) -> str | None:
    if system is None or isinstance(system, str):
        return system
    texts = []
    for j, block in enumerate(system):
        if block.get("type") != "text":
            raise located("system", f"system[{j}]: only text blocks are allowed, got {block.get('type')!r}")
        texts.append(_text_of(block, f"system[{j}]"))
    return "\n".join(texts)


def _image_part(block: dict, where: str) -> dict:
    source = block.get("source")
    if not isinstance(source, dict):
        raise located("messages", f"{where}.source: must be an object")
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise located("messages", f"{where}.source: a base64 source needs 'media_type' and 'data' strings")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise located("messages", f"{where}.source.url: must be a string")
        return {"type": "image_url", "image_url": {"url": url}}
    raise located("messages", f"{where}.source.type: {kind!r} is not supported; supported: 'base64', 'url'")


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise located("messages", f"{where}.content[{k}]: tool results may hold text blocks only, got {kind!r}")
            parts.append(_text_of(part, f"{where}.content[{k}]"))
        text = "\n".join(parts)
    else:
        raise located("messages", f"{where}.content: must be a string or a list of text blocks")
    return f"Error: {text}" if block.get("is_error") else text


def _user_messages(content: list[dict], where: str) -> list[dict]:
    tool_messages, parts = [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _text_of(block, at)})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise located("messages", f"{at}.tool_use_id: must be a non-empty string")
            tool_messages.append({"role": "tool", "tool_call_id": call_id, "content": _tool_result_text(block, at)})
        else:
            raise located("messages", f"{at}: user content blocks of type {kind!r} are not supported; "
                                      "supported: 'text', 'image', 'tool_result'")
    out = list(tool_messages)
    if parts:
        has_image = any(p["type"] == "image_url" for p in parts)
        out.append({"role": "user", "content": parts if has_image else "\n".join(p["text"] for p in parts)})
    return out


def _assistant_message(content: list[dict], where: str) -> dict:
    texts, calls, reasoning = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_use":
            name, call_id = block.get("name"), block.get("id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise located("messages", f"{at}: a tool_use block needs 'id' and 'name' strings")
            args = block.get("input", {})
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "thinking":
            thinking = block.get("thinking") or ""
            if not isinstance(thinking, str):
                raise located("messages", f"{at}.thinking: must be a string")
            reasoning.append(thinking)
        elif kind == "redacted_thinking":
            continue
        else:
            raise located("messages", f"{at}: assistant content blocks of type {kind!r} are not supported; "
                                      "supported: 'text', 'tool_use', 'thinking'")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return message


def chat_messages(req: CountTokensRequest) -> list[dict]:
    messages: list[dict] = []
    system = system_text(req.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        where = f"messages[{i}]"
        if message.role not in ("user", "assistant"):
            raise located("messages", f"{where}.role: must be 'user' or 'assistant', got {message.role!r}")
        content = message.content
        if isinstance(content, str):
            messages.append({"role": message.role, "content": content})
        elif message.role == "user":
            messages.extend(_user_messages(content, where))
        else:
            messages.append(_assistant_message(content, where))
    return messages


def _tools(req: CountTokensRequest) -> list[dict] | None:
    if not req.tools:
        return None
    tools = []
    for i, tool in enumerate(req.tools):
        if tool.type not in (None, "custom"):
            raise located("tools", f"tools[{i}]: server tools ({tool.type!r}) are not supported; only client tools "
                                   "with an input_schema")
        tools.append({"type": "function", "function": {
            "name": tool.name, "description": tool.description,
            "parameters": tool.input_schema or {"type": "object", "properties": {}}}})
    return tools


def _tool_choice(req: CountTokensRequest) -> tuple[Any, bool]:
    """(chat tool_choice, parallel calls allowed)."""
    choice = req.tool_choice
    if choice is None:
        return None, True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "auto":
        return "auto", parallel
    if choice.type == "any":
        return "required", parallel
    if choice.type == "none":
        return "none", parallel
    if choice.type == "tool":
        if not choice.name:
            raise located("tool_choice", "tool_choice.name: is required with type 'tool'")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    raise located("tool_choice", f"tool_choice.type: {choice.type!r}; allowed: 'auto', 'any', 'tool', 'none'")


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat-completions request `req` means (validation errors name the Messages API's fields)."""
    if req.mcp_servers:
        raise invalid("mcp_servers", "MCP servers are not supported")
    if req.container is not None:
        raise invalid("container", "containers (code execution) are not supported")
    tool_choice, parallel = _tool_choice(req)
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), "tools": _tools(req),
                            "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    if req.thinking is not None:
        if req.thinking.type not in ("enabled", "disabled", "adaptive"):
            raise located("thinking", f"thinking.type: {req.thinking.type!r}; allowed: 'enabled', 'disabled', 'adaptive'")
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    config = req.output_config
    if config is not None and config.effort is not None:
        body["reasoning_effort"] = config.effort
    if config is not None and config.format is not None:
        fmt = config.format
        if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise located("output_config", "output_config.format: must be {'type': 'json_schema', 'schema': {...}}")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    if isinstance(req, MessagesRequest):
        body.update(max_completion_tokens=max(req.max_tokens, 1), stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k, seed=req.seed, stream=req.stream,
                    disable_any_whitespace=req.disable_any_whitespace)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise located(where.split(".")[0] or "request", f"{where}: {err.get('msg')}") from None
