"""Real servers for the tests: uvicorn on 127.0.0.1 (a free port) in a background thread,
serving an AsyncLLM whose engine core runs in its own (spawned) process."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from typing import Any

import httpx
import uvicorn

from portaserve.framework.config import EngineConfig
from portaserve.framework.server.app import create_app
from portaserve.framework.server.state import ServerSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """`with ServerThread(config, settings) as srv:` -> srv.url, srv.state (engine, metrics)."""

    def __init__(self, config: EngineConfig, settings: ServerSettings | None = None, ready_timeout: float = 240.0) -> None:
        from portaserve.framework.engine.core_client import AsyncLLM
        from portaserve.framework.engine.startup import resolve_engine

        self.spec = resolve_engine(config)
        spec = self.spec

        async def factory() -> Any:
            engine = await asyncio.to_thread(AsyncLLM, config, spec)
            await engine.start()
            return engine

        self.app = create_app(settings or ServerSettings(), engine_factory=factory, spec=spec)
        self.state = self.app.state.portaserve
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, "127.0.0.1", self.port, log_level="warning",
                                                    timeout_graceful_shutdown=3))
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.ready_timeout = ready_timeout
        self.health_seen: list[int] = []

    def __enter__(self) -> "ServerThread":
        # One OpenMP thread in the engine process: the test machines are small and shared,
        # and oversubscribed OpenMP threads spin (a tiny model's step gets ~6x slower).
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            return self._start()
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved

    def _start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            try:
                status = httpx.get(self.url + "/health", timeout=5).status_code
                self.health_seen.append(status)
                if status == 200:
                    return self
                if status == 500:
                    raise RuntimeError(f"the engine failed to start: {self.state.load_error}")
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise TimeoutError("the test server did not become ready")

    @property
    def engine(self) -> Any:
        return self.state.engine

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        series, _, label_text = head.partition("{")
        if series != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return float(value)
    return 0.0
