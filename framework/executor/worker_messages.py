"""The typed messages between the driver and its workers (framework/wire.py encodes them).

The same protocol runs over a local worker's pipe and over the control connection of a
rank on another node (multinode.py):

- a remote rank first says `Hello` and gets `Init` (the EngineSpec) or `Reject`;
- then the driver sends `Call`s, each answered by one `Reply`.

A `Call` names one of `WORKER_METHODS`, whose table fixes the argument and result types;
the worker decodes the arguments into exactly those types and runs nothing else, so a
forged call can at most be a malformed message (an error reply), never code.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from portaserve.framework.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from portaserve.framework.engine.startup import EngineSpec
from portaserve.framework.wire import MAX_MESSAGE_BYTES, WireError, decode, encode

from .weight_update import StageResult


class Hello(msgspec.Struct, tag=True):
    """A remote rank introducing itself to the driver."""

    rank: int
    host: str


class Init(msgspec.Struct, tag=True):
    """The driver's answer to a welcome rank: what to build and where to rendezvous."""

    spec: EngineSpec
    world_size: int
    init_method: str


class Reject(msgspec.Struct, tag=True):
    reason: str


class Call(msgspec.Struct, tag=True):
    """Run `method` (one of WORKER_METHODS) with `args` (its argument tuple, encoded)."""

    method: str
    args: msgspec.Raw


class Reply(msgspec.Struct, tag=True):
    """A call's result (encoded as the method's result type), or its error text."""

    ok: bool
    value: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    error: str | None = None


Handshake = Hello | Init | Reject

#: method -> (argument tuple type, result type): everything a worker can be asked to do.
WORKER_METHODS: dict[str, tuple[Any, Any]] = {
    "load_model": (tuple[()], None),  # the worker's first reply: its model is built (or why not)
    "determine_num_blocks": (tuple[()], int),
    "initialize_kv_cache": (tuple[int], None),
    "execute_model": (tuple[SchedulerOutput], ModelRunnerOutput | None),
    "weights_info": (tuple[()], dict[str, Any]),
    "stage_weights_from_folder": (tuple[str], StageResult),
    "init_weight_update_group": (tuple[str, int, int, int, float | None], StageResult),
    "destroy_weight_update_group": (tuple[()], None),
    "stage_weights_from_distributed": (tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], str | None], StageResult),
    "commit_staged_weights": (tuple[()], int),
    "discard_staged_weights": (tuple[()], None),
    "sleep": (tuple[int], dict[str, Any]),
    "wake_up": (tuple[list[str] | None], dict[str, Any]),
    "shutdown": (tuple[()], None),
    "lora_stats": (tuple[()], dict[str, int]),
}


def _signature(method: str) -> tuple[Any, Any]:
    try:
        return WORKER_METHODS[method]
    except KeyError:
        raise WireError(f"unknown worker method {method!r}") from None


def call_bytes(method: str, args: tuple) -> bytes:
    _signature(method)
    return encode(Call(method, msgspec.Raw(encode(tuple(args)))))


def read_call(data: bytes) -> tuple[str, tuple]:
    """A call's method and its arguments, decoded into the method's types."""
    call = decode(data, Call)
    arg_types, _ = _signature(call.method)
    return call.method, tuple(decode(call.args, arg_types))


def reply_bytes(value: Any) -> bytes:
    return encode(Reply(True, msgspec.Raw(encode(value))))


def error_bytes(error: str) -> bytes:
    return encode(Reply(False, error=error))


def read_reply(data: bytes, method: str) -> tuple[bool, Any]:
    """(ok, the result decoded as the method's result type) or (False, the error text)."""
    reply = decode(data, Reply)
    if not reply.ok:
        return False, reply.error or "a worker failed without saying why"
    _, result_type = _signature(method)
    return True, decode(reply.value, result_type)


def recv(conn: Any) -> bytes:
    """One message's bytes from a pipe or a remote connection, at most MAX_MESSAGE_BYTES."""
    try:
        return conn.recv_bytes(MAX_MESSAGE_BYTES)
    except OSError as exc:
        if "bad message length" in str(exc):
            raise WireError(f"a message over {MAX_MESSAGE_BYTES} bytes") from None
        raise
