"""The engine core in its own process, for `serve`.

The API process (HTTP, tokenization, chat rendering, detokenization) and this process
(scheduling and the model step) overlap: while the model runs a step here, the API
process parses requests and streams the previous step's tokens. Messages travel over
two ZeroMQ sockets (PUSH/PULL, ipc://): requests in, outputs out. Payloads are pickled
(requests carry SamplingParams; a step's outputs are a list of small frozen dataclasses).

Input messages: ("add", [Request]), ("abort", [req_id]), ("finish", [req_id]),
("call", call_id, method, args), ("shutdown",).
Output messages: ("ready", info), ("outputs", [EngineCoreOutput], SchedulerStats),
("result", call_id, ok, value), ("dead", message).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import sys
import traceback
from typing import Any

logger = logging.getLogger("portaserve")

# Methods of EngineCore the client may call through ("call", ...).
CALLABLE_METHODS = frozenset(
    {"stats", "reset_prefix_cache", "update_weights", "sleep", "wake_up", "is_sleeping", "weights_info", "check_health",
     "init_weight_update_group", "update_weights_from_distributed", "destroy_weight_update_group"}
)
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

    def send(msg: tuple) -> None:
        outbox.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        from portaserve.framework.engine.core import EngineCore

        core = EngineCore(spec)
    except BaseException as exc:
        send(("dead", f"engine failed to start: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        outbox.close()
        ctx.term()
        sys.exit(1)
    send(("ready", {"num_blocks": core.num_blocks, "pid": os.getpid()}))
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    deferred: list[tuple] = []  # DRAINING_METHODS calls waiting for the running requests
    held: list[list[Any]] = []  # "add" groups (one prompt's children) that arrived while a deferred call waits
    try:
        while True:
            # Block while idle; with work queued, only drain what has already arrived.
            timeout = 0 if core.has_unfinished_requests() or deferred else None
            events = dict(poller.poll(timeout))
            while inbox in events:
                msg = pickle.loads(inbox.recv())
                if msg[0] == "shutdown":
                    return
                if msg[0] == "call" and msg[2] in DRAINING_METHODS and msg[2] in CALLABLE_METHODS:
                    deferred.append(msg)
                elif msg[0] == "add" and deferred:
                    held.append(msg[1])
                else:
                    if msg[0] == "abort" and held:
                        gone = set(msg[1])
                        held = [group for group in ([r for r in g if r.request_id not in gone] for g in held) if group]
                    _handle(core, msg, send)
                events = dict(poller.poll(0))
            if core.has_unfinished_requests():
                outputs = core.step()
                send(("outputs", outputs, core.stats()))
            elif deferred:
                for msg in deferred:
                    _handle(core, msg, send)
                deferred = []
                for group in held:
                    _handle(core, ("add", group), send)
                held = []
    except BaseException as exc:  # a dead engine must say why, then exit
        send(("dead", f"engine core died: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    finally:
        try:
            core.shutdown()
        finally:
            inbox.close(linger=0)
            outbox.close()
            ctx.term()


def _handle(core: Any, msg: tuple, send) -> None:
    kind = msg[0]
    if kind == "add":
        # one message per prompt: its children, added together or not at all
        try:
            core.add_requests(msg[1])
        except ValueError as exc:  # validated in the front end; report, don't die
            send(("rejected", msg[1][0].request_id, str(exc)))
    elif kind == "abort":
        core.abort_requests(msg[1])
    elif kind == "finish":
        core.finish_requests(msg[1])
    elif kind == "call":
        _, call_id, method, args = msg
        if method not in CALLABLE_METHODS or not hasattr(core, method):
            send(("result", call_id, False, ValueError(f"unknown engine method {method!r}")))
            return
        try:
            value = getattr(core, method)(*args)
            send(("result", call_id, True, value))
        except Exception as exc:
            try:
                pickle.loads(pickle.dumps(exc))  # the client must be able to rebuild it
            except Exception:
                exc = RuntimeError(f"{type(exc).__name__}: {exc}")
            send(("result", call_id, False, exc))
    else:
        logger.error("engine core: unknown message %r", kind)
