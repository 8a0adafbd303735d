"""The engine core in its own process, for `serve`.

The API process (HTTP, tokenization, chat rendering, detokenization) and this process
(scheduling and the model step) overlap: while the model runs a step here, the API
process parses requests and streams the previous step's tokens. Messages travel over
two ZeroMQ sockets (PUSH/PULL, ipc:// in a private temporary folder): requests in,
outputs out. They are the typed messages of core_messages.py (msgspec, never pickle):
a payload that is not one of them is logged and dropped, never run.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import traceback
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
    # The client starts this process as a daemon (it dies with the client), and
    # multiprocessing forbids a daemon to start processes; tensor-parallel workers are
    # children of this process, so it must not count as one from the inside.
    multiprocessing.current_process()._config["daemon"] = False
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
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


