"""The typed messages between the server's `AsyncLLM` and its engine-core process.

Two ZeroMQ sockets carry them (core_process.py), encoded by framework/wire.py: requests
in (`ToCore`), outputs out (`FromCore`). Each side decodes into exactly these types, so
a payload that is anything else (a pickle, say) is a malformed message, never code.

A `CallCore` names one of `CORE_METHODS`, which fixes its argument and result types;
its errors come back as `ErrorInfo` and are rebuilt as the same exception classes.
"""

from __future__ import annotations

from typing import Any

import msgspec

from portaserve.framework.errors import EngineDeadError, InvalidParameterError, RequestFailedError, UnsupportedError
from portaserve.framework.wire import WireError, decode, encode

from .request import Request
from .scheduler import SchedulerStats
from .scheduler_output import EngineCoreOutput

# ----- to the engine core ----------------------------------------------------------------


class AddRequests(msgspec.Struct, tag="add"):
    """The sequences of one prompt (its `n` children), added together."""

    requests: list[Request]


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Finish(msgspec.Struct, tag="finish"):
    """Requests the front end ended (a stop string matched)."""

    request_ids: list[str]


class CallCore(msgspec.Struct, tag="call"):
    call_id: int
    method: str
    args: msgspec.Raw


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


ToCore = AddRequests | Abort | Finish | CallCore | Shutdown

# ----- from the engine core --------------------------------------------------------------


class Ready(msgspec.Struct, tag="ready"):
    num_blocks: int
    pid: int


class Outputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


class ErrorInfo(msgspec.Struct):
    """An exception from the engine core: its class (one of ours) and message."""

    kind: str
    message: str
    param: str | None = None


class Result(msgspec.Struct, tag="result"):
    call_id: int
    ok: bool
    value: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    error: ErrorInfo | None = None


class Rejected(msgspec.Struct, tag="rejected"):
    request_id: str
    message: str
    param: str | None = None


class Dead(msgspec.Struct, tag="dead"):
    message: str


FromCore = Ready | Outputs | Result | Rejected | Dead

#: method -> (argument tuple type, result type): what the server may ask the engine core.
CORE_METHODS: dict[str, tuple[Any, Any]] = {
    "stats": (tuple[()], SchedulerStats),
    "reset_prefix_cache": (tuple[()], bool),
    "update_weights": (tuple[str], dict[str, Any]),
    "sleep": (tuple[int], dict[str, Any]),
    "wake_up": (tuple[list[str] | None], dict[str, Any]),
    "is_sleeping": (tuple[()], bool),
    "weights_info": (tuple[()], dict[str, Any]),
    "check_health": (tuple[()], None),
    "init_weight_update_group": (tuple[str, int, int, int, float | None], dict[str, Any]),
    "update_weights_from_distributed": (tuple[list[str], list[str], list[list[int]]], dict[str, Any]),
    "destroy_weight_update_group": (tuple[()], None),
    "lora_stats": (tuple[()], dict[str, int]),
}

_ERRORS: dict[str, type[BaseException]] = {
    "InvalidParameterError": InvalidParameterError,
    "UnsupportedError": UnsupportedError,
    "EngineDeadError": EngineDeadError,
    "RequestFailedError": RequestFailedError,
}


def signature(method: str) -> tuple[Any, Any]:
    try:
        return CORE_METHODS[method]
    except KeyError:
        raise WireError(f"unknown engine method {method!r}") from None


def call_message(call_id: int, method: str, args: tuple) -> bytes:
    signature(method)
    return encode(CallCore(call_id, method, msgspec.Raw(encode(tuple(args)))))


def call_args(call: CallCore) -> tuple:
    arg_types, _ = signature(call.method)
    return tuple(decode(call.args, arg_types))


def error_info(exc: BaseException) -> ErrorInfo:
    kind = type(exc).__name__ if type(exc).__name__ in _ERRORS else "RuntimeError"
    if kind == "RuntimeError" and isinstance(exc, ValueError):
        kind = "ValueError"
    message = str(exc) if kind != "RuntimeError" else f"{type(exc).__name__}: {exc}"
    return ErrorInfo(kind, message, getattr(exc, "param", None))


def rebuild_error(info: ErrorInfo) -> BaseException:
    if info.kind == "InvalidParameterError":
        return InvalidParameterError(info.param or "request", info.message)
    if info.kind == "ValueError":
        return ValueError(info.message)
    return _ERRORS.get(info.kind, RuntimeError)(info.message)


def result_message(call_id: int, value: Any) -> bytes:
    return encode(Result(call_id, True, msgspec.Raw(encode(value))))


def result_value(result: Result, method: str) -> Any:
    _, result_type = signature(method)
    return decode(result.value, result_type)
