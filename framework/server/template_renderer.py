"""Request-supplied chat templates render in a separate process that can be stopped.

jinja's sandbox stops a template from leaving it, not from running long: nested loops can
keep a render going for hours. With `--trust-request-chat-template`, a request's own
template therefore renders in a worker process (one, started on first use and reused);
when a render passes `--chat-template-timeout` the worker is killed, the request gets a
400 on `chat_template`, and the next render starts a fresh worker. The arguments cross as
JSON (they came from a JSON request), never pickle.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
from typing import Any

from portaserve.framework.errors import InvalidParameterError, invalid


def _worker(conn) -> None:
    from portaserve.framework.engine.chat import render_chat

    while True:
        try:
            kwargs = json.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            reply = {"text": render_chat(**kwargs)}
        except InvalidParameterError as exc:
            reply = {"param": exc.param, "error": str(exc)}
        except Exception as exc:  # render_chat maps template errors; anything else is reported too
            reply = {"param": "chat_template", "error": f"chat_template: {type(exc).__name__}: {exc}"}
        conn.send_bytes(json.dumps(reply).encode())


class IsolatedTemplateRenderer:
    """`render(timeout, **render_chat_kwargs)` in a killable worker process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None
        self._warm = False  # the worker has answered once (its start-up is behind it)

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child,), name="portaserve-template-render", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        self._warm = False

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def render(self, timeout: float, **kwargs: Any) -> str:
        """The rendered text, or an InvalidParameterError (a template error, or the timeout)."""
        try:
            payload = json.dumps(kwargs).encode()
        except (TypeError, ValueError):
            raise invalid("messages", "messages: the conversation is not JSON-serializable") from None
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send_bytes(payload)
            # the first render also waits for the worker to start (a spawned interpreter)
            if not self._conn.poll(timeout + (0.0 if self._warm else 5.0)):
                self._stop()
                raise invalid(
                    "chat_template",
                    f"rendering the request's chat template took longer than {timeout:g} s and was stopped "
                    "(--chat-template-timeout)",
                )
            try:
                reply = json.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                self._stop()
                raise invalid("chat_template", "the process rendering the request's chat template died") from None
            self._warm = True
        if "error" in reply:
            raise InvalidParameterError(reply["param"], reply["error"])
        return reply["text"]

    def close(self) -> None:
        with self._lock:
            self._stop()
