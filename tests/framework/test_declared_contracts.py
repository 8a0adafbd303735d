"""What used to be vendor tests inside the framework, now declared by platforms: the Ray
resource, the compute units kernels size grids by, graph capture, and the weight-update
group a communicator builds. A platform written against 1.0 (none of these declared)
gets defaults that keep it working. Also the checking `AttentionBackend.forward` (1.1),
which a 1.0 backend overriding `forward` bypasses."""

from __future__ import annotations

import dataclasses
import socket
import time
from dataclasses import dataclass

import pytest
import torch

from portaserve.framework import device_properties
from portaserve.framework.distributed import StandaloneGroupCommunicator
from portaserve.framework.executor.ray_executor import bundle_for
from portaserve.framework.interfaces import (
    AttentionBackend,
    AttentionMetadata,
    AttentionSpec,
    Communicator,
    DeviceInfo,
    Platform,
    PlatformCapabilities,
)


class OldPlatform(Platform):
    """A 1.0 platform: declares nothing of the above."""

    name = "old"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def probe(cls):
        return DeviceInfo(cls.name, "fake", 1, 2**30, -5, "always")

    def capabilities(self):
        return PlatformCapabilities(dtypes=frozenset({torch.float32}), kv_cache_dtypes=frozenset({"auto"}))

    def _torch_device(self, local_rank):
        return torch.device("cpu")

    def _memory_info(self, local_rank):
        return 2**30, 2**30


class UnitsPlatform(OldPlatform):
    name = "units"
    ray_resource = "NPU"

    def _torch_device(self, local_rank):
        return torch.device("meta", local_rank)

    def compute_units(self, local_rank=0):
        return 33


def test_a_10_platform_gets_the_defaults():
    platform = OldPlatform(OldPlatform.probe())
    assert platform.graph_capture("inductor") is None
    assert platform.compute_units() is None
    assert bundle_for(OldPlatform) == {"CPU": 1.0}


def test_ray_resources_are_declared_by_the_platforms():
    from portaserve.platforms.cpu.platform import CpuPlatform
    from portaserve.platforms.cuda.platform import CudaPlatform
    from portaserve.platforms.rocm.platform import RocmPlatform
    from portaserve.platforms.tpu.platform import TpuPlatform
    from portaserve.platforms.xpu.platform import XpuPlatform

    assert bundle_for(CpuPlatform) == {"CPU": 1.0}
    assert bundle_for(CudaPlatform) == bundle_for(RocmPlatform) == bundle_for(XpuPlatform) == {"GPU": 1.0}
    assert bundle_for(TpuPlatform) == {"TPU": 1.0}
    assert bundle_for(UnitsPlatform) == {"NPU": 1.0}


def test_kernels_size_grids_by_the_published_compute_units():
    from portaserve.kernels.triton_backend import INTERPRETER_TARGET_PROGRAMS, PROGRAMS_PER_UNIT, target_programs

    platform = UnitsPlatform(DeviceInfo("units", "fake", 2, 2**30, -5, "always"))
    device = platform.torch_device(1)
    assert target_programs(device) == INTERPRETER_TARGET_PROGRAMS  # nothing published yet
    device_properties.publish(platform, 1)
    assert device_properties.compute_units(device) == 33
    assert target_programs(device) == PROGRAMS_PER_UNIT * 33
    # a platform without compute units publishes nothing
    device_properties.publish(OldPlatform(OldPlatform.probe()), 0)
    assert device_properties.compute_units(torch.device("cpu")) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_default_weight_update_group_is_a_standalone_gloo_group():
    class OldComm(Communicator):
        """A 1.0 communicator: no weight-update group of its own."""

        name = "old_comm"
        platforms = frozenset({"old"})

        def _all_reduce(self, tensor, op): ...
        def _all_gather(self, tensor, dim): ...
        def _reduce_scatter(self, tensor, dim): ...
        def _broadcast(self, tensor, src): ...
        def _send(self, tensor, dst): ...
        def _recv(self, tensor, src): ...
        def _barrier(self): ...

    port = _free_port()
    for _ in range(2):  # destroy() releases the group's name: the same address works again
        comm = OldComm.weight_update_group(0, 1, torch.device("cpu"), "127.0.0.1", port, timeout_s=30)
        assert isinstance(comm, StandaloneGroupCommunicator) and comm.group is not None
        assert comm.all_reduce(torch.ones(2), op="max").tolist() == [1.0, 1.0]
        comm.destroy()
        assert comm.group is None


# ----- AttentionBackend.forward: a checking wrapper around _forward (1.1) ----------------


@dataclass(frozen=True, slots=True)
class _Metadata(AttentionMetadata):
    pass


class _Attention(AttentionBackend):
    """A 1.1 backend: defines `_forward`; attention is a copy of v (enough to see the call)."""

    name = "copy_v"
    platforms = None
    supported_dtypes = frozenset({torch.float32})
    supported_block_sizes = frozenset({16})
    supports_encoder = True
    metadata_type = _Metadata

    def kv_cache_shape(self, num_blocks):
        return (num_blocks, 2, 16, self.spec.num_kv_heads, self.spec.head_size)

    def build_metadata(self, batch):
        return _Metadata(batch.num_actual_tokens)

    def _forward(self, q, k, v, kv_cache, metadata):
        return v.repeat_interleave(self.spec.gqa_ratio, dim=1)


class _OldAttention(_Attention):
    """A 1.0 backend: overrides `forward` itself (no checks run) and accepts any metadata."""

    def forward(self, q, k, v, kv_cache, metadata):
        return q * 2


SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, scale=0.35, dtype=torch.float32)


def _qkv(n=3, heads=4, kv_heads=2, d=8, dtype=torch.float32):
    return torch.ones(n, heads, d, dtype=dtype), torch.ones(n, kv_heads, d, dtype=dtype), torch.ones(n, kv_heads, d, dtype=dtype)


def test_attention_forward_checks_its_inputs_then_calls_forward_():
    backend = _Attention(SPEC, 16, torch.device("cpu"))
    cache = torch.zeros(backend.kv_cache_shape(2))
    assert backend.forward(*_qkv(), cache, _Metadata(3)).shape == (3, 4, 8)
    for bad, match in (
        (_qkv(heads=2), "expected q"),
        (_qkv(kv_heads=4), "expected q"),
        (_qkv(d=4), "expected q"),
        ((*_qkv()[:2], torch.ones(2, 2, 8)), "expected q"),  # v has fewer tokens than q
        (_qkv(dtype=torch.float64), "dtypes"),
    ):
        with pytest.raises(ValueError, match=match):
            backend.forward(*bad, cache, _Metadata(3))
    with pytest.raises(ValueError, match="KV cache is required"):
        backend.forward(*_qkv(), None, _Metadata(3))
    with pytest.raises(TypeError, match="not _Metadata"):
        backend.forward(*_qkv(), cache, AttentionMetadata(3))
    # an encoder layer has no cache
    encoder = _Attention(dataclasses.replace(SPEC, causal=False), 16, torch.device("cpu"))
    assert encoder.forward(*_qkv(), None, _Metadata(3)).shape == (3, 4, 8)


def test_a_10_attention_backend_overriding_forward_keeps_working():
    backend = _OldAttention(SPEC, 16, torch.device("cpu"))
    q, k, v = _qkv()
    assert torch.equal(backend.forward(q, k, v, None, AttentionMetadata(3)), q * 2)  # unchecked, as in 1.0


def test_an_attention_backend_must_define_forward_():
    class NoForward(_Attention):
        _forward = AttentionBackend._forward

    with pytest.raises(TypeError, match="defines no _forward"):
        NoForward(SPEC, 16, torch.device("cpu"))


def test_the_attention_check_costs_microseconds():
    # the check runs once per layer and step: attribute reads only, no device sync
    backend = _Attention(SPEC, 16, torch.device("cpu"))
    q, k, v = _qkv()
    cache, md = torch.zeros(backend.kv_cache_shape(2)), _Metadata(3)
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        backend.forward(q, k, v, cache, md)
    checked = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(n):
        backend._forward(q, k, v, cache, md)
    bare = time.perf_counter() - start
    assert (checked - bare) / n < 50e-6, f"{(checked - bare) / n * 1e6:.1f} us per call"
