"""`AsyncLLM`: the async engine client the server uses.

It resolves the engine (plugins, platform, plan) in this process, starts the engine
core in a spawned process (`core_process`; or takes the one an `EngineCoreLauncher`
started earlier), and keeps the front end here: input
processing, detokenization, stop strings and per-request output queues. A dead engine
process fails every in-flight request with `EngineDeadError` at once and turns health
unhealthy; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from portaserve.framework.config import EngineConfig
from portaserve.framework.engine.llm_engine import load_tokenizer
from portaserve.framework.engine.output_processor import OutputProcessor
from portaserve.framework.engine.outputs import EmbeddingRequestOutput, RequestOutput
from portaserve.framework.engine.params import PoolingParams, SamplingParams
from portaserve.framework.engine.processor import InputProcessor
from portaserve.framework.engine.startup import EngineSpec, resolve_engine
from portaserve.framework.errors import EngineDeadError, InvalidParameterError, RequestFailedError, invalid
from portaserve.framework.wire import WireError, decode, encode

from .core_messages import (
    Abort,
    AddRequests,
    Dead,
    Finish,
    FromCore,
    Outputs,
    Ready,
    Rejected,
    Result,
    Shutdown,
    call_message,
    rebuild_error,
    result_value,
)
from .scheduler import SchedulerStats
from .scheduler_output import EngineCoreOutput

if TYPE_CHECKING:
    from .core_process import EngineCoreLauncher

logger = logging.getLogger("portaserve")

#: Called once per engine step with the step's scheduler stats and its outputs.
StatsListener = Callable[[SchedulerStats, list[EngineCoreOutput]], None]


class AsyncLLM:
    """Async generate / encode / abort against an engine core in another process."""

    def __init__(self, config: EngineConfig, spec: EngineSpec | None = None, *,
                 launcher: EngineCoreLauncher | None = None) -> None:
        """`launcher`: an engine-core process already started (`portaserve serve` starts it
        before resolving the plan); None: `start()` spawns one."""
        self.config = config
        self.spec = spec or resolve_engine(config)
        self._launcher = launcher
        self.tokenizer = load_tokenizer(self.spec)
        self.processor = InputProcessor(self.spec, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.queues: dict[str, asyncio.Queue] = {}
        self.latest_stats: Any = None
        self.ready = False
        self.dead_reason: str | None = None
        self.num_blocks = 0
        self._calls: dict[int, tuple[str, asyncio.Future]] = {}  # call id -> (method, its future)
        self._call_ids = itertools.count()
        self._ids = itertools.count()
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task | None = None
        self._ready_event: asyncio.Event | None = None
        self._stats_listeners: list[StatsListener] = []
        if launcher is not None:
            self._ipc_dir, self._in_addr, self._out_addr = launcher.ipc_dir, launcher.input_addr, launcher.output_addr
        else:
            self._ipc_dir = tempfile.mkdtemp(prefix="portaserve-ipc-")
            self._in_addr = f"ipc://{os.path.join(self._ipc_dir, 'in')}"
            self._out_addr = f"ipc://{os.path.join(self._ipc_dir, 'out')}"

    # ----- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine core (or take the launcher's) and wait until it has loaded the model."""
        import zmq
        import zmq.asyncio

        from portaserve.framework.engine.core_process import run_engine_core

        self._loop = asyncio.get_running_loop()
        self._zctx = zmq.asyncio.Context()
        self._to_core = self._zctx.socket(zmq.PUSH)
        self._to_core.bind(self._in_addr)
        self._from_core = self._zctx.socket(zmq.PULL)
        self._from_core.bind(self._out_addr)
        self._ready_event = asyncio.Event()
        if self._launcher is not None:
            self._launcher.send(self.spec)  # a no-op when the driver has sent it already
            self._proc = self._launcher.proc
        else:
            mp = multiprocessing.get_context("spawn")
            self._proc = mp.Process(
                target=run_engine_core, args=(self.spec, self._in_addr, self._out_addr), name="portaserve-engine-core",
                daemon=True,
            )
            self._proc.start()
        self._reader = asyncio.create_task(self._read_outputs())
        threading.Thread(target=self._watch_process, name="portaserve-engine-watch", daemon=True).start()
        await self._ready_event.wait()
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _watch_process(self) -> None:
        """Notice the engine process dying even when it could not say why."""
        proc = self._proc
        assert proc is not None
        proc.join()
        if self._loop is not None and not self._loop.is_closed():
            code = proc.exitcode
            self._loop.call_soon_threadsafe(self._mark_dead, f"engine process exited with code {code}")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None and not getattr(self, "_shutting_down", False):
            self.dead_reason = reason
            logger.error("engine is dead: %s", reason)
        elif self.dead_reason is None:
            self.dead_reason = reason
        self.ready = False
        err = EngineDeadError(self.dead_reason)
        for q in self.queues.values():
            q.put_nowait(err)
        for _, fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()
        if self._ready_event is not None:
            self._ready_event.set()

    @property
    def is_healthy(self) -> bool:
        return self.ready and self.dead_reason is None

    def add_stats_listener(self, listener: StatsListener) -> None:
        """Call `listener(stats, outputs)` after every engine step (on the event loop; it
        must not block). The server's metrics are one."""
        self._stats_listeners.append(listener)

    async def shutdown(self) -> None:
        self._shutting_down = True
        try:
            if self._proc is not None and self._proc.is_alive():
                if self.dead_reason is None:  # a dead core is exiting already: just wait
                    await self._send(encode(Shutdown()))
                await asyncio.get_running_loop().run_in_executor(None, self._proc.join, 10)
                if self._proc.is_alive():
                    self._proc.kill()
        finally:
            if self._reader is not None:
                self._reader.cancel()
            for sock in (getattr(self, "_to_core", None), getattr(self, "_from_core", None)):
                if sock is not None:
                    sock.close(linger=0)
            if getattr(self, "_zctx", None) is not None:
                self._zctx.term()

    # ----- the output loop ------------------------------------------------------------

    async def _send(self, data: bytes) -> None:
        """One encoded message (core_messages.py) to the engine core."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        await self._to_core.send(data)

    async def _read_outputs(self) -> None:
        while True:
            try:
                raw = await self._from_core.recv()
            except asyncio.CancelledError:
                return
            except Exception as exc:  # socket closed under us during shutdown
                if self.dead_reason is None:
                    self._mark_dead(f"lost the engine connection: {exc}")
                return
            try:
                msg = decode(raw, FromCore)
            except WireError as exc:
                # The engine core sends typed messages only, so this came from elsewhere (a
                # process of this user writing into the 0700 socket folder): dropped, never
                # unpickled, and not allowed to take the server down.
                logger.warning("dropped a malformed message on the engine-core channel: %s", exc)
                continue
            if isinstance(msg, Outputs):
                self.latest_stats = msg.stats
                self._dispatch(msg.outputs)
                for listener in self._stats_listeners:
                    listener(msg.stats, msg.outputs)
            elif isinstance(msg, Ready):
                self.num_blocks = msg.num_blocks
                self.ready = True
                self._ready_event.set()
            elif isinstance(msg, Result):
                method, fut = self._calls.pop(msg.call_id, (None, None))
                if fut is None or fut.done():
                    continue
                if not msg.ok:
                    fut.set_exception(rebuild_error(msg.error) if msg.error is not None else RuntimeError("call failed"))
                    continue
                try:
                    value = result_value(msg, method)
                except WireError as exc:
                    fut.set_exception(RuntimeError(f"{method}: {exc}"))
                    continue
                if isinstance(value, dict) and "weights_version" in value:
                    # before any later output is dispatched: those ran on the new weights
                    self.output_processor.weights_version = int(value["weights_version"])
                fut.set_result(value)
            elif isinstance(msg, Rejected):
                parent = self.output_processor.child_to_parent.get(msg.request_id)
                if parent is not None:
                    q = self.queues.get(parent.request_id)
                    if q is not None:
                        q.put_nowait(InvalidParameterError(msg.param or "request", msg.message))
            elif isinstance(msg, Dead):
                self._mark_dead(msg.message)
                return

    def _dispatch(self, core_outputs: list) -> None:
        outputs, to_finish = self.output_processor.process_outputs(core_outputs)
        if to_finish:
            asyncio.ensure_future(self._send(encode(Finish(to_finish))))
        for out in outputs:
            q = self.queues.get(out.request_id)
            if q is not None:
                error = getattr(out, "error", None)
                q.put_nowait(RequestFailedError(error) if error is not None else out)

    # ----- requests --------------------------------------------------------------------

    def next_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    async def generate(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        """Stream a request's outputs; cancelling the iteration aborts the request."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self.queues:
            raise invalid("request_id", f"{request_id!r} is already in flight")
        processed = self.processor.process(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                           lora_request=lora_request)
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        self.output_processor.add_request(processed)
        finished = False
        try:
            await self._send(encode(AddRequests(list(processed.children))))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        children = self.output_processor.child_ids(request_id)
        if not children:
            return
        self.output_processor.abort_request(request_id)
        if self.dead_reason is None:
            await self._send(encode(Abort(list(children))))

    async def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Run an EngineCore utility method in the engine process and return its result."""
        call_id = next(self._call_ids)
        data = call_message(call_id, method, args)  # an unknown method or unencodable arguments fail here
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (method, fut)
        await self._send(data)
        return await asyncio.wait_for(fut, timeout)

    def num_in_flight(self) -> int:
        return len(self.queues)

    @property
    def weights_version(self) -> int:
        """0 at start, +1 per successful weight update (reported in /v1/models)."""
        return self.output_processor.weights_version
