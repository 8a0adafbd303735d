"""`portaserve chat` and `portaserve complete`: talk to a running OpenAI-compatible server
(portaserve's or any other), streaming the answer to the terminal.

`chat` is interactive (one line of stdin per user turn, the conversation kept) unless
`--message` gives a one-shot question; `complete` sends one prompt (the argument, or
stdin). `--model` defaults to the first model `/v1/models` lists. The reasoning of a
reasoning model (`reasoning_content`) is printed between `<think>` markers on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

DEFAULT_BASE_URL = "http://localhost:8000/v1"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", DEFAULT_BASE_URL),
                   help=f"the server's API root (default: $OPENAI_BASE_URL or {DEFAULT_BASE_URL})")
    p.add_argument("--api-key", default=os.environ.get("PORTASERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="API key (default: $PORTASERVE_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    p.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--no-stream", action="store_true", help="wait for the whole answer instead of streaming it")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server (default: 600)")


def add_parser(subparsers) -> None:
    chat = subparsers.add_parser("chat", help="chat with a running OpenAI-compatible server",
                                 description=__doc__.split("\n\n")[0])
    _common(chat)
    chat.add_argument("--message", "-m", action="append", default=None,
                      help="send this user message and exit (repeat for several turns in one conversation)")
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.set_defaults(func=run_chat)

    complete = subparsers.add_parser("complete", help="complete a prompt on a running OpenAI-compatible server",
                                     description=__doc__.split("\n\n")[0])
    _common(complete)
    complete.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read stdin)")
    complete.set_defaults(func=run_complete)


class Client:
    """The few calls the commands need, over httpx."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def _check(self, response) -> None:
        if response.status_code >= 400:
            response.read()
            try:
                message = response.json()["error"]["message"]
            except Exception:
                message = response.text
            raise ClientError(f"HTTP {response.status_code}: {message}")

    def first_model(self) -> str:
        response = self.http.get("/models")
        self._check(response)
        data = response.json().get("data") or []
        if not data:
            raise ClientError("the server lists no models")
        return data[0]["id"]

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post(path, json=body)
        self._check(response)
        return response.json()

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The decoded `data:` events of a streamed response, until `[DONE]`."""
        with self.http.stream("POST", path, json={**body, "stream": True}) as response:
            self._check(response)
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if isinstance(event, dict) and event.get("error"):
                    raise ClientError(f"server error mid-stream: {event['error'].get('message')}")
                yield event


class ClientError(Exception):
    pass


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "seed"):
        value = getattr(args, name)
        if value is not None:
            body[name] = value
    return body


def _connect(args: argparse.Namespace) -> tuple[Client, str]:
    client = Client(args.base_url, args.api_key, args.timeout)
    return client, args.model or client.first_model()


class _Printer:
    """Answer text to stdout; reasoning to stderr, between <think> markers."""

    def __init__(self, out=None, err=None) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.thinking = False

    def reasoning(self, text: str) -> None:
        if text:
            if not self.thinking:
                self.err.write("<think>")
                self.thinking = True
            self.err.write(text)
            self.err.flush()

    def content(self, text: str) -> None:
        if text:
            self._close()
            self.out.write(text)
            self.out.flush()

    def tool_call(self, name: str, arguments: str) -> None:
        self._close()
        self.out.write(f"\n[tool call] {name}({arguments})")
        self.out.flush()

    def _close(self) -> None:
        if self.thinking:
            self.err.write("</think>\n")
            self.thinking = False

    def end(self) -> None:
        self._close()
        self.out.write("\n")
        self.out.flush()


def chat_turn(client: Client, model: str, messages: list[dict], args: argparse.Namespace, printer: _Printer) -> str:
    """Send the conversation, print the answer as it arrives, return its text."""
    body = {"model": model, "messages": messages, **_sampling(args)}
    parts: list[str] = []
    if args.no_stream:
        message = client.post("/chat/completions", body)["choices"][0]["message"]
        printer.reasoning(message.get("reasoning_content") or "")
        printer.content(message.get("content") or "")
        for call in message.get("tool_calls") or []:
            printer.tool_call(call["function"]["name"], call["function"]["arguments"])
        printer.end()
        return message.get("content") or ""
    for event in client.stream("/chat/completions", body):
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            printer.reasoning(delta.get("reasoning_content") or "")
            text = delta.get("content") or ""
            parts.append(text)
            printer.content(text)
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                printer.tool_call(fn.get("name") or "", fn.get("arguments") or "")
    printer.end()
    return "".join(parts)


def run_chat(args: argparse.Namespace) -> int:
    try:
        client, model = _connect(args)
        messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
        printer = _Printer()
        if args.message:
            for text in args.message:
                messages.append({"role": "user", "content": text})
                messages.append({"role": "assistant", "content": chat_turn(client, model, messages, args, printer)})
            return 0
        interactive = sys.stdin.isatty()
        if interactive:
            print(f"chatting with {model} at {args.base_url} (Ctrl-D to quit)", file=sys.stderr)
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:
                return 0
            line = line.rstrip("\n")
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            messages.append({"role": "assistant", "content": chat_turn(client, model, messages, args, printer)})
    except ClientError as exc:
        print(f"portaserve chat: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # connection refused, timeouts: say so, no traceback
        print(f"portaserve chat: cannot talk to {args.base_url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def run_complete(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    try:
        client, model = _connect(args)
        body = {"model": model, "prompt": prompt, **_sampling(args)}
        if args.no_stream:
            print(client.post("/completions", body)["choices"][0]["text"])
            return 0
        for event in client.stream("/completions", body):
            for choice in event.get("choices") or []:
                sys.stdout.write(choice.get("text") or "")
                sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    except ClientError as exc:
        print(f"portaserve complete: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        print(f"portaserve complete: cannot talk to {args.base_url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
