"""The engine core in its own process, for `serve`.

The API process (HTTP, tokenization, chat rendering, detokenization) and this process
(scheduling and the model step) overlap: while the model runs a step here, the API
process parses requests and streams the previous step's tokens. Messages travel over
two ZeroMQ sockets (PUSH/PULL, ipc:// in a private temporary folder): requests in,
outputs out. They are the typed messages of core_messages.py (msgspec, never pickle):
a payload that is not one of them is logged and dropped, never run.

`portaserve serve` starts this process before it has a plan (`EngineCoreLauncher`), right
after importing torch (`import_torch_before_fork`: forked, the process inherits it): while
the driver loads the plugins, probes and resolves the ExecutionPlan, this process imports
the engine and opens the model file; the plan then arrives over a pipe and the engine is
built at once. The plan is still resolved once, in the driver.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any

from portaserve.framework.wire import WireError, decode, encode

from .core_messages import (
    Abort,
    AddRequests,
    CallCore,
    Dead,
    Finish,
    Outputs,
    Ready,
    Rejected,
    Result,
    Shutdown,
    ToCore,
    call_args,
    error_info,
    result_message,
)

logger = logging.getLogger("portaserve")

# Calls that first let the requests already in the engine finish (on the old weights);
# requests that arrive meanwhile are held and added once the call has returned.
DRAINING_METHODS = frozenset({"update_weights", "update_weights_from_distributed", "sleep"})


def run_engine_core(spec: Any, input_addr: str, output_addr: str) -> None:
    """Process entry point (spawned): build the core, report ready, serve until shutdown."""
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    # No cyclic GC while the engine is built: imports and the weights create millions of
    # objects, and the collections they trigger were a quarter of torch's import and
    # most of reading a GGUF vocabulary. It is back on before the first request, with what
    # the start left frozen (never scanned: the first collection would be a full one
    # through all of it, 0.2-0.4 s, and finds a few thousand small objects to free).
    gc.disable()
    # The client starts this process as a daemon (it dies with the client), and
    # multiprocessing forbids a daemon to start processes; tensor-parallel workers are
    # children of this process, so it must not count as one from the inside.
    multiprocessing.current_process()._config["daemon"] = False
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    # A launched core may connect before the front end has bound (it retries): soon.
    inbox.setsockopt(zmq.RECONNECT_IVL, 10)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.RECONNECT_IVL, 10)
    outbox.connect(output_addr)
    outbox.setsockopt(zmq.LINGER, 2000)

    def send(data: bytes) -> None:
        outbox.send(data)

    try:
        from portaserve.framework.engine.core import EngineCore

        core = EngineCore(spec)
    except BaseException as exc:
        send(encode(Dead(f"engine failed to start: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
        outbox.close()
        ctx.term()
        sys.exit(1)
    send(encode(Ready(core.num_blocks, os.getpid())))
    gc.freeze()
    gc.enable()
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    deferred: list[CallCore] = []  # DRAINING_METHODS calls waiting for the running requests
    held: list[AddRequests] = []  # prompts that arrived while a deferred call waits
    try:
        while True:
            # Block while idle; with work queued, only drain what has already arrived.
            timeout = 0 if core.has_unfinished_requests() or deferred else None
            events = dict(poller.poll(timeout))
            while inbox in events:
                try:
                    msg = decode(inbox.recv(), ToCore)
                except WireError as exc:
                    logger.error("engine core: dropped a message: %s", exc)
                    events = dict(poller.poll(0))
                    continue
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, CallCore) and msg.method in DRAINING_METHODS:
                    deferred.append(msg)
                elif isinstance(msg, AddRequests) and deferred:
                    held.append(msg)
                else:
                    if isinstance(msg, Abort) and held:
                        gone = set(msg.request_ids)
                        held = [AddRequests(kept) for kept in ([r for r in m.requests if r.request_id not in gone]
                                                               for m in held) if kept]
                    _handle(core, msg, send)
                events = dict(poller.poll(0))
            if core.has_unfinished_requests():
                outputs = core.step()
                send(encode(Outputs(outputs, core.stats())))
            elif deferred:
                for msg in deferred:
                    _handle(core, msg, send)
                deferred = []
                for msg in held:
                    _handle(core, msg, send)
                held = []
    except BaseException as exc:  # a dead engine must say why, then exit
        send(encode(Dead(f"engine core died: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")))
        raise
    finally:
        try:
            core.shutdown()
        finally:
            inbox.close(linger=0)
            outbox.close()
            ctx.term()


def _handle(core: Any, msg: Any, send) -> None:
    if isinstance(msg, AddRequests):
        if not msg.requests:
            return
        # one message per prompt: its children, added together or not at all
        try:
            core.add_requests(msg.requests)
        except ValueError as exc:  # validated in the front end; report, don't die
            send(encode(Rejected(msg.requests[0].request_id, str(exc), getattr(exc, "param", None))))
    elif isinstance(msg, Abort):
        core.abort_requests(msg.request_ids)
    elif isinstance(msg, Finish):
        core.finish_requests(msg.request_ids)
    elif isinstance(msg, CallCore):
        try:
            args = call_args(msg)
            value = getattr(core, msg.method)(*args)
            send(result_message(msg.call_id, value))
        except Exception as exc:
            send(encode(Result(msg.call_id, False, error=error_info(exc))))




# ----- starting the process before the plan ------------------------------------------------


def start_method() -> str:
    """How to start the engine process: "fork" where that copies nothing that could be
    inconsistent in the child (Linux, and this process still has a single thread: no
    thread pool, device runtime or lock held by another thread), else "spawn"."""
    if not sys.platform.startswith("linux") or "fork" not in multiprocessing.get_all_start_methods():
        return "spawn"
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = threading.active_count()
    return "fork" if threads == 1 else "spawn"


def import_torch_before_fork() -> None:
    """Import torch now, before `EngineCoreLauncher` forks: both processes need it, and the
    engine process then inherits it instead of importing its own (0.85 s of CPU here;
    with one of the dev machine's 2 cores busy elsewhere, /health 200 came 0.9 s sooner).

    Importing torch imports numpy, whose OpenBLAS starts its worker threads as it loads:
    this process would no longer be single-threaded, and `start_method` would spawn. So
    OpenBLAS loads with one thread here (and in the forked engine, which does no numpy
    linear algebra), unless OPENBLAS_NUM_THREADS is set already.
    """
    if "torch" in sys.modules:
        return
    saved = os.environ.get("OPENBLAS_NUM_THREADS")
    if saved is None:
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import torch  # noqa: F401
    finally:
        if saved is None:  # processes started later get OpenBLAS's default
            os.environ.pop("OPENBLAS_NUM_THREADS", None)


class EngineCoreLauncher:
    """The engine-core process, started before the driver resolves the plan.

    Start it as early as possible (the driver has parsed its flags and nothing else),
    then `send(spec)` once the plan is resolved, or `cancel()` when the driver stops
    before that. Until the spec arrives the process only imports what every engine needs
    (torch, the plugins, the executor) and opens the model's file; it never chooses a
    platform or a plan itself.
    The spec goes over a one-way pipe to this child only, as `spawn` sends its arguments.
    """

    def __init__(self, config: Any = None) -> None:
        """`config`: the EngineConfig, whose model file (a local GGUF file) the process opens
        while it waits, as the loader will (the open file is cached per process)."""
        self.ipc_dir = tempfile.mkdtemp(prefix="portaserve-ipc-")
        self.input_addr = f"ipc://{os.path.join(self.ipc_dir, 'in')}"
        self.output_addr = f"ipc://{os.path.join(self.ipc_dir, 'out')}"
        self.start_method = start_method()
        ctx = multiprocessing.get_context(self.start_method)
        reader, self._writer = ctx.Pipe(duplex=False)
        self._done = False
        self.proc = ctx.Process(
            target=_launched_engine_core, args=(reader, self.input_addr, self.output_addr, config),
            name="portaserve-engine-core", daemon=True,
        )
        self.proc.start()
        reader.close()

    @property
    def sent(self) -> bool:
        """The spec was sent, or the launch cancelled: the pipe is done with."""
        return self._done

    def send(self, spec: Any) -> None:
        """Hand the resolved EngineSpec to the process: it builds the engine from here on."""
        if self._done:
            return
        self._done = True
        data = ForkingPickler.dumps(spec)
        # A thread writes it: a spec larger than the pipe's buffer would otherwise hold the
        # driver until the process has finished its imports and reads.
        threading.Thread(target=self._write, args=(data,), name="portaserve-send-spec", daemon=True).start()

    def _write(self, data: bytes) -> None:
        try:
            self._writer.send_bytes(data)
        except OSError:  # it died already; the client's watcher reports the exit
            pass
        finally:
            self._writer.close()

    def cancel(self) -> None:
        """The driver stops before a plan: the process sees the pipe close and exits."""
        if not self._done:
            self._done = True
            self._writer.close()


def _preload(config: Any, conn: Any) -> None:
    """What building any engine imports, done while the driver resolves the plan; then,
    if the plan is still to come, the model's GGUF file opened (a local file only)."""
    try:
        import torch  # noqa: F401

        from portaserve.framework.engine import core  # noqa: F401
        from portaserve.framework.executor import worker  # noqa: F401
        from portaserve.framework.plugins import get_registry

        get_registry(strict=False)  # strictness is checked when the engine is built
        if config is None or conn.poll():
            return
        from pathlib import Path

        from portaserve.framework.checkpoint import default_model_file
        from portaserve.framework.gguf import is_gguf_path, open_gguf

        path = default_model_file() if config.model is None else Path(config.model).expanduser()
        if path is not None and is_gguf_path(path):
            open_gguf(path)
    except Exception:  # the engine reports any of it when it is built for real
        pass


def _launched_engine_core(conn: Any, input_addr: str, output_addr: str, config: Any = None) -> None:
    """Process entry point of `EngineCoreLauncher`: preload, wait for the spec, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    gc.disable()  # until the engine is ready (run_engine_core)
    if not conn.poll():  # nothing yet: neither the spec nor the driver's cancel
        _preload(config, conn)
    try:
        spec = ForkingPickler.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return  # the driver stopped before its plan and reports why
    finally:
        conn.close()
    run_engine_core(spec, input_addr, output_addr)
