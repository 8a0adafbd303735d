"""Chat rendering: messages -> prompt text through the model's jinja chat template.

Templates come from model folders and from users (`--chat-template`), so they are
untrusted code: they run in jinja2's `ImmutableSandboxedEnvironment` (no attribute
starting with `_`, no mutating methods of lists and dicts), with the options and helpers
Hugging Face templates expect: trim_blocks and lstrip_blocks, loop controls
(`{% break %}`), `raise_exception(message)`, `strftime_now(format)`, a `tojson` that
does not HTML-escape (`ensure_ascii`, `indent`, `separators`, `sort_keys` options) and a
`{% generation %}` block that renders its body.

What the template sees, as in vLLM and transformers:

- `messages`: plain dicts, keys whose value is None dropped; text content parts
  flattened into one string (joined with newlines); an assistant tool call's
  `function.arguments` given as a JSON string parsed into an object (templates write it
  back with `tojson`); `reasoning_content`, `reasoning` and `thinking` aliased to each other;
- `tools` (OpenAI function tools, as given), `add_generation_prompt`, the `bos_token`
  and `eos_token`, and every `chat_template_kwargs` entry (e.g. `enable_thinking`).

Errors are `InvalidParameterError`s (HTTP 400): a conversation the template rejects or
cannot render names `messages`; a template that does not compile or tries to leave the
sandbox names `chat_template`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from portaserve.framework.errors import InvalidParameterError, invalid

#: Context names the caller controls; chat_template_kwargs cannot replace them.
_RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message"})
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
# Appended to the final message for continue_final_message and cut off after rendering.
# The trailing space tells whether the template kept the message's trailing whitespace.
_CONTINUE_MARK = "\u2063portaserve-continue\u2063 "


def load_chat_template(value: str | os.PathLike) -> str:
    """A `--chat-template` value: the path of a template file, or the template itself."""
    text = os.fspath(value)
    if os.path.isfile(text):
        with open(text, encoding="utf-8") as f:
            return f.read()
    if "{{" in text or "{%" in text:
        return text
    raise invalid("chat_template", f"{text!r} is neither a file nor a jinja template (no '{{{{' or '{{%')")


# ----- the sandbox -----------------------------------------------------------------------------


class TemplateRejection(Exception):
    """Raised by `raise_exception` in a template: the template refuses this conversation."""


@lru_cache(maxsize=1)
def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < (3, 1, 6):
        # earlier releases have known sandbox escapes, and templates are untrusted code
        raise RuntimeError(f"chat templates need jinja2 >= 3.1.6 (installed: {jinja2.__version__}); pip install -U jinja2")

    class GenerationBlock(Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        # serving only needs the text.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    class SafeNamespace(jinja2.utils.Namespace):
        # Keeps templates from storing dunder-like attributes on a namespace object.
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            SafeNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")

    def raise_exception(message: Any) -> None:
        raise TemplateRejection(str(message))

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    def make_dict(*args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = SafeNamespace
    env.globals["dict"] = make_dict
    return env


@lru_cache(maxsize=64)
def _compile(template: str):
    import jinja2

    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise invalid("chat_template", f"the template does not compile (line {e.lineno}): {e.message}") from None


# ----- the template's inputs --------------------------------------------------------------------


def _plain(value: Any, where: str) -> Any:
    """JSON-like data only: the sandbox then never sees an object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    dump = getattr(value, "model_dump", None)
    if callable(dump):  # pydantic models (the server's request types, the openai client's)
        return _plain(dump(exclude_none=True), where)
    raise InvalidParameterError(
        where.split(".")[0].split("[")[0],
        f"{where}: must be JSON-like data (string, number, boolean, null, list, object), got {type(value).__name__}",
    )


IMAGE_PART_TYPES = ("image_url", "image")


def image_url_of(part: Any, where: str) -> Any:
    """The URL of an OpenAI `image_url` content part (`detail` is accepted and ignored);
    for an `image` part (the offline API's), its `image` value: a PIL image or a URL."""
    if part.get("type") == "image" and part.get("image") is not None and not isinstance(part.get("image"), str):
        return part["image"]
    value = part.get("image_url") if part.get("type") == "image_url" else part.get("image", part.get("url"))
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise invalid("messages", f"{where}.image_url.url: must be a non-empty string (a data:, http(s) or file URL)")
    return url


def _flatten_content(content: Any, where: str) -> str | list | None:
    """Text parts joined into one string; a message with images keeps its parts, as
    [{"type": "text", "text"}, {"type": "image"}, ...], for the template to place them."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("messages", f"{where}: must be a string or a list of content parts, got {type(content).__name__}")
    texts = []
    parts: list[dict] = []
    has_image = False
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            parts.append({"type": "text", "text": part})
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PART_TYPES:
            if kind == "image_url":
                image_url_of(part, f"{where}[{j}]")
            has_image = True
            parts.append({"type": "image"})
            continue
        if kind != "text":
            shown = kind if kind is not None else type(part).__name__
            raise invalid("messages", f"{where}[{j}]: content parts of type {shown!r} are not supported; "
                          "supported: 'text', 'image_url'")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid("messages", f"{where}[{j}].text: must be a string")
        texts.append(text)
        parts.append({"type": "text", "text": text})
    return parts if has_image else "\n".join(texts)


def chat_image_urls(messages: Any) -> list[tuple[str, str]]:
    """(url, "messages[i].content[j]") of every image part, in conversation order."""
    found = []
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                where = f"messages[{i}].content[{j}]"
                found.append((image_url_of(part, where), where))
    return found


def _normalize_message(message: Any, i: int) -> dict:
    where = f"messages[{i}]"
    data = _plain(message, where)
    if not isinstance(data, dict):
        raise invalid("messages", f"{where}: must be an object with a 'role', got {type(message).__name__}")
    data = {k: v for k, v in data.items() if v is not None}
    role = data.get("role")
    if not isinstance(role, str) or not role:
        raise invalid("messages", f"{where}.role: must be a non-empty string")
    if "content" in data:
        data["content"] = _flatten_content(data["content"], f"{where}.content")
    reasoning = next((data[k] for k in _REASONING_KEYS if isinstance(data.get(k), str)), None)
    if reasoning is not None:
        for key in _REASONING_KEYS:
            data.setdefault(key, reasoning)
    calls = data.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise invalid("messages", f"{where}.tool_calls: must be a list")
        for k, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    raise invalid("messages", f"{where}.tool_calls[{k}].function.arguments: is not valid JSON") from None
    return data


def normalize_messages(messages: Any) -> list[dict]:
    """The messages as the template sees them (see the module docstring)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise invalid("messages", f"must be a list of messages, got {type(messages).__name__}")
    return [_normalize_message(m, i) for i, m in enumerate(messages)]


def _check_tools(tools: Any) -> list | None:
    if tools is None:
        return None
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise invalid("tools", f"must be a list of tools, got {type(tools).__name__}")
    plain = _plain(list(tools), "tools")
    for i, tool in enumerate(plain):
        if not isinstance(tool, dict):
            raise invalid("tools", f"tools[{i}]: must be an object")
    return plain


def _check_kwargs(kwargs: Any) -> dict:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise invalid("chat_template_kwargs", f"must be an object, got {type(kwargs).__name__}")
    bad = sorted(k for k in kwargs if not isinstance(k, str) or k in _RESERVED_KWARGS)
    if bad:
        raise invalid(
            "chat_template_kwargs",
            f"{bad} cannot be set here (pass messages, tools, add_generation_prompt and continue_final_message directly)",
        )
    return _plain(dict(kwargs), "chat_template_kwargs")


# ----- rendering ---------------------------------------------------------------------------------


def render_chat(
    template: str | None,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> str:
    """Render a conversation into prompt text with `template`.

    :param add_generation_prompt: end with the opening of an assistant turn.
    :param continue_final_message: leave the final (assistant) message open, so the model
        continues it instead of starting a new turn: the text rendered after it (the
        end-of-turn marker) is cut off. Needs `add_generation_prompt=False`.
    :param tools: OpenAI function tools, passed to the template as `tools`.
    :param chat_template_kwargs: extra template variables (e.g. `{"enable_thinking": False}`).
    :param bos_token, eos_token: the tokenizer's tokens, for templates that write them.
    :raises InvalidParameterError: see the module docstring.
    """
    import jinja2

    if not template:
        raise invalid(
            "chat_template",
            "this model has no chat template; pass --chat-template FILE (or the template text) to serve chat requests, "
            "or use completions with a prompt",
        )
    if continue_final_message and add_generation_prompt:
        raise invalid(
            "continue_final_message",
            "cannot be combined with add_generation_prompt; set add_generation_prompt to false to continue the final message",
        )
    msgs = normalize_messages(messages)
    if continue_final_message:
        if not msgs or msgs[-1]["role"] != "assistant":
            got = repr(msgs[-1]["role"]) if msgs else "an empty conversation"
            raise invalid("continue_final_message", f"the last message must be an assistant message to continue, got {got}")
        final = msgs[-1].get("content") or ""
        if isinstance(final, list):
            msgs[-1]["content"] = final + [{"type": "text", "text": _CONTINUE_MARK}]
        else:
            msgs[-1]["content"] = final + _CONTINUE_MARK
    context: dict[str, Any] = _check_kwargs(chat_template_kwargs)
    if bos_token is not None:
        context.setdefault("bos_token", bos_token)
    if eos_token is not None:
        context.setdefault("eos_token", eos_token)
    compiled = _compile(template)
    try:
        text = compiled.render(messages=msgs, tools=_check_tools(tools), add_generation_prompt=bool(add_generation_prompt), **context)
    except TemplateRejection as e:
        raise invalid("messages", f"the chat template rejected the conversation: {e}") from None
    except jinja2.exceptions.SecurityError as e:
        raise invalid("chat_template", f"the template tried something the sandbox forbids: {e}") from None
    except InvalidParameterError:
        raise
    except Exception as e:  # undefined variables, type errors in template expressions, ...
        raise invalid("messages", f"the chat template could not render this conversation: {type(e).__name__}: {e}") from None
    if continue_final_message:
        mark = _CONTINUE_MARK.rstrip()
        at = text.rfind(mark)
        if at < 0:
            raise invalid(
                "continue_final_message",
                "the chat template does not keep the final message's text, so it cannot be continued",
            )
        # The mark's trailing space survived: the template kept the message's whitespace as given.
        text = text[:at] if text.startswith(_CONTINUE_MARK, at) else text[:at].rstrip()
    return text


def without_image_data(messages: Any) -> Any:
    """The conversation with each image part reduced to {"type": "image"} (what the
    template needs): the offline API's parts may hold PIL images, which are not JSON."""
    if not isinstance(messages, list):
        return messages
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = [{"type": "image"} if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES else p for p in content]
            message = {**message, "content": content}
        out.append(message)
    return out
