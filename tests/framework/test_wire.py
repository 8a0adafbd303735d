"""Messages between processes are typed (framework/wire.py): the engine's own objects
round-trip, anything else (a pickle that would run code, a forged call) is a malformed
message and runs nothing; connections to other hosts prove a shared secret first."""

from __future__ import annotations

import os
import pickle
import threading
from multiprocessing import Pipe

import pytest

from portaserve.framework.engine.params import SamplingParams
from portaserve.framework.engine.request import Request
from portaserve.framework.engine.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from portaserve.framework.wire import WireError, decode, encode, handshake


class _Exploit:
    """Unpickling this runs `os.system`: what a pickle-based channel would execute."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def exploit(tmp_path) -> tuple[bytes, object]:
    marker = tmp_path / "pwned"
    return pickle.dumps(_Exploit(marker)), marker


def test_the_engines_objects_round_trip():
    sp = SamplingParams(max_tokens=5, stop=["x"], stop_token_ids=[7], logit_bias={3: 1.5}, seed=4, n=2)
    step = SchedulerOutput(
        (NewRequestData("a", (1, 2), (), sp, None, (1,), 0),), (CachedRequestData("b", (2,), 3),),
        {"a": 2, "b": 1}, 3, frozenset({"c"}),
    )
    back = decode(encode(step), SchedulerOutput)
    assert back == step and back.new_requests[0].sampling_params.all_stop_token_ids == {7}
    out = ModelRunnerOutput(
        sampled_token_ids={"a": 5}, logprobs={"a": Logprobs(5, -0.1, 1, (5,), (-0.1,))}, errors={"b": "boom"}
    )
    assert decode(encode(out), ModelRunnerOutput) == out
    request = Request("r-1", [1, 2, 3], sampling_params=sp, eos_token_ids=frozenset({0}), max_tokens=5)
    again = decode(encode(request), Request)
    assert again.prompt_token_ids == [1, 2, 3] and again.eos_token_ids == frozenset({0})
    assert again.sampling_params == sp
    core = EngineCoreOutput(req_id="a", new_token_ids=(5,), finish_reason="error", error="x")
    assert decode(encode(core), EngineCoreOutput) == core


def test_a_callable_cannot_be_sent():
    sp = SamplingParams(max_tokens=5, logits_processors=[lambda ids, row: row])
    with pytest.raises(WireError, match="--logits-processors"):
        encode(Request("r", [1], sampling_params=sp))


def test_a_pickle_is_a_malformed_message_and_runs_nothing(tmp_path):
    from portaserve.framework.engine.core_messages import ToCore
    from portaserve.framework.executor.worker_messages import Hello, read_call

    payload, marker = exploit(tmp_path)
    for kind in (ToCore, SchedulerOutput, Hello):
        with pytest.raises(WireError):
            decode(payload, kind)
    with pytest.raises(WireError):
        read_call(payload)
    assert not marker.exists()


def test_a_worker_runs_only_its_declared_methods():
    import msgspec

    from portaserve.framework.executor.worker_messages import Call, call_bytes, read_call

    assert read_call(call_bytes("initialize_kv_cache", (12,))) == ("initialize_kv_cache", (12,))
    with pytest.raises(WireError, match="unknown worker method"):
        read_call(encode(Call("__init__", msgspec.Raw(encode(())))))
    with pytest.raises(WireError, match="unknown worker method"):
        call_bytes("load_weights_from_anywhere", ())
    with pytest.raises(WireError):  # wrong argument types
        read_call(encode(Call("initialize_kv_cache", msgspec.Raw(encode(("twelve",))))))


def test_an_engine_core_call_names_a_known_method():
    import msgspec

    from portaserve.framework.engine.core_messages import CallCore, call_args, call_message, signature

    assert signature("sleep")
    assert call_args(decode(call_message(3, "sleep", (2,)), CallCore)) == (2,)
    with pytest.raises(WireError, match="unknown engine method"):
        call_message(1, "shutdown_machine", ())
    with pytest.raises(WireError):
        call_args(CallCore(1, "sleep", msgspec.Raw(encode(("deep",)))))


def _both_sides(key_a: bytes, key_b: bytes):
    a, b = Pipe()
    errors: dict[str, BaseException] = {}

    def other():
        try:
            handshake(b, key_b, initiator=False, timeout=5)
        except BaseException as exc:
            errors["b"] = exc

    thread = threading.Thread(target=other)
    thread.start()
    try:
        handshake(a, key_a, initiator=True, timeout=5)
    except BaseException as exc:
        errors["a"] = exc
    thread.join(10)
    return errors


def test_handshake_needs_the_same_secret_on_both_sides():
    assert _both_sides(b"k" * 32, b"k" * 32) == {}
    errors = _both_sides(b"k" * 32, b"j" * 32)
    assert isinstance(errors.get("a"), WireError) and isinstance(errors.get("b"), WireError)
    assert "shared secret" in str(errors["a"])


def test_handshake_refuses_a_peer_that_sends_something_else(tmp_path):
    a, b = Pipe()
    payload, marker = exploit(tmp_path)
    b.send_bytes(payload)  # a pickle instead of a 32-byte challenge
    with pytest.raises(WireError):
        handshake(a, b"k" * 32, initiator=False, timeout=2)
    c, d = Pipe()
    with pytest.raises(WireError, match="said nothing"):  # a silent peer
        handshake(c, b"k" * 32, initiator=False, timeout=0.2)
    assert not marker.exists()


def test_multi_node_needs_an_explicit_secret(monkeypatch):
    from portaserve.framework.config import EngineConfig
    from portaserve.framework.engine.startup import resolve_engine
    from portaserve.framework.errors import InvalidParameterError

    monkeypatch.delenv("PORTASERVE_CLUSTER_KEY", raising=False)
    config = EngineConfig.create(tensor_parallel_size=2, nnodes=2, device="cpu")
    with pytest.raises(InvalidParameterError) as err:
        resolve_engine(config)
    assert err.value.param == "PORTASERVE_CLUSTER_KEY" and "secrets.token_hex" in str(err.value)
    monkeypatch.setenv("PORTASERVE_CLUSTER_KEY", "short")
    with pytest.raises(InvalidParameterError, match="at least 16 bytes"):
        resolve_engine(config)
