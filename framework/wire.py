"""Typed messages between portaserve's processes: msgspec's msgpack, never pickle.

Every channel (the server's engine-core IPC, the driver's pipes to its worker processes,
the step channel to other nodes' ranks) sends msgspec-encoded messages and decodes them
into the one type the receiver expects. A payload that does not decode into that type
is a `WireError`, never code: unlike pickle, decoding cannot run anything. The engine's
own frozen dataclasses (SchedulerOutput, ModelRunnerOutput, EngineCoreOutput,
EngineSpec, ...) cross as they are; the hooks here add what msgspec does not know:
torch dtypes (by name), pydantic models (as their JSON), sets.

Callables cannot cross: per-request logits processors (Python objects) work with the
in-process engine of the `LLM` API; everywhere else processors are named
(`--logits-processors module:Class`) and instantiated where they run.

`handshake` authenticates a connection to another host with a shared secret (an
HMAC-SHA256 challenge each way) before any message is read from it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any, TypeVar

import msgspec

from portaserve.framework.errors import PortaserveError

T = TypeVar("T")

#: Largest message a connection accepts from another host (a step of a large batch is a
#: few MB; model weights never cross these channels).
MAX_MESSAGE_BYTES = 256 * 2**20


class WireError(PortaserveError, ValueError):
    """A message that is not what the channel carries (malformed, unknown, too large)."""


def _enc_hook(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    resolve = getattr(obj, "wire_value", None)  # a value still being computed (a PendingBitmask)
    if resolve is not None:
        return resolve()
    dump = getattr(obj, "model_dump", None)  # a pydantic model (EngineConfig)
    if dump is not None:
        return dump(mode="json")
    if callable(obj):
        raise WireError(
            f"{obj!r} is a Python callable, which cannot be sent to another process: per-request logits processors "
            "work with the in-process engine only; name a processor class instead (--logits-processors module:Class)"
        )
    raise WireError(f"cannot send a {type(obj).__name__} between processes")


def _dec_hook(kind: type, obj: Any) -> Any:
    import torch

    if kind is torch.dtype:
        value = getattr(torch, str(obj), None)
        if not isinstance(value, torch.dtype):
            raise WireError(f"{obj!r} is not a torch dtype")
        return value
    validate = getattr(kind, "model_validate", None)  # pydantic
    if validate is not None:
        return validate(obj)
    raise WireError(f"cannot receive a {kind!r}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(message: Any) -> bytes:
    """The message's msgpack bytes."""
    try:
        return _encoder.encode(message)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"cannot encode {type(message).__name__}: {exc}") from None


def decode(data: bytes, kind: type[T] | Any) -> T:
    """`data` as a `kind` (a Struct, dataclass, union of tagged Structs, tuple type, ...).

    :raises WireError: the bytes are not a valid `kind`.
    """
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook)
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, WireError) as exc:
        raise WireError(f"a malformed message ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # a pydantic or dataclass validation failure inside
        raise WireError(f"a malformed message ({type(exc).__name__}: {exc})") from None


def convert(value: Any, kind: type[T] | Any) -> T:
    """An already-decoded (builtin) value as `kind`, validated like `decode`."""
    try:
        return msgspec.convert(value, kind, dec_hook=_dec_hook)
    except Exception as exc:
        raise WireError(f"a malformed value ({type(exc).__name__}: {exc})") from None


# ----- authentication of connections to other hosts -----------------------------------------

_CHALLENGE_BYTES = 32
_DIGEST = "sha256"


def _answer(key: bytes, challenge: bytes, role: bytes) -> bytes:
    return hmac.new(key, role + challenge, _DIGEST).digest()


def handshake(conn: Any, key: bytes, initiator: bool, timeout: float = 30.0) -> None:
    """Mutual HMAC-SHA256 challenge-response over `conn` (send_bytes / recv_bytes).

    Each side sends a random challenge and checks the other's answer before either
    reads anything else, so a peer without the key never gets a message decoded. The
    role byte keeps one side's answer from being replayed as the other's.

    :raises WireError: the peer does not know the key, or sent something else.
    """
    if not key:
        raise WireError("no shared secret to authenticate with")
    def wait() -> None:  # a silent peer must not hold the listener
        if not conn.poll(timeout):
            raise WireError(f"the peer said nothing for {timeout:g} s")

    mine = os.urandom(_CHALLENGE_BYTES)
    conn.send_bytes(mine)
    try:
        wait()
        theirs = conn.recv_bytes(_CHALLENGE_BYTES)
    except OSError as exc:  # maxlength exceeded, or the peer hung up
        raise WireError(f"the peer's challenge is not {_CHALLENGE_BYTES} bytes ({exc})") from None
    if len(theirs) != _CHALLENGE_BYTES:
        raise WireError("the peer's challenge has the wrong length")
    my_role, their_role = (b"i", b"r") if initiator else (b"r", b"i")
    conn.send_bytes(_answer(key, theirs, my_role))
    try:
        wait()
        answer = conn.recv_bytes(hashlib.new(_DIGEST).digest_size)
    except OSError as exc:
        raise WireError(f"the peer's answer is malformed ({exc})") from None
    if not hmac.compare_digest(answer, _answer(key, mine, their_role)):
        raise WireError("the peer does not know the shared secret (PORTASERVE_CLUSTER_KEY differs)")
