"""Conformance: declared capabilities are consistent, and the components the platform
names (preferred attention backends, default communicator and KV-cache allocator)
resolve in the registry for this platform."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from portaserve.framework.config import CompilationMode, EngineConfig, KVCacheDtype
from portaserve.framework.errors import InvalidParameterError
from portaserve.framework.interfaces import AttentionBackend, Communicator, KVCacheAllocator, PlatformCapabilities
from portaserve.framework.plan import DTYPES, resolve_platform_choices

KV_CACHE_DTYPES = frozenset(get_args(KVCacheDtype))
COMPILATION_MODES = frozenset(get_args(CompilationMode)) - {"none"}


@pytest.fixture(scope="module")
def caps(platform) -> PlatformCapabilities:
    return platform.capabilities()


def test_capabilities_are_well_formed(caps):
    assert isinstance(caps, PlatformCapabilities)
    assert caps.dtypes and all(isinstance(d, torch.dtype) for d in caps.dtypes)
    assert set(caps.dtypes) & set(DTYPES.values()), f"none of the model dtypes {sorted(DTYPES)} is supported"
    assert "auto" in caps.kv_cache_dtypes and caps.kv_cache_dtypes <= KV_CACHE_DTYPES, caps.kv_cache_dtypes
    assert all(isinstance(f, str) and f for f in caps.features)
    assert set(caps.compile_backends) <= COMPILATION_MODES, caps.compile_backends
    assert all(isinstance(b, str) and b for b in caps.compile_backends.values())
    assert caps.default_compilation_mode in {"none", *caps.compile_backends}
    cap = caps.serving_prefill_cap
    assert cap is None or (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1), cap
    assert caps.block_sizes and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in caps.block_sizes)
    assert caps.default_block_size in caps.block_sizes
    assert all(d in caps.dtypes for d in caps.preferred_dtypes), caps.preferred_dtypes


def test_capabilities_are_stable(platform, caps):
    assert platform.capabilities() == caps


def test_identity(platform, platform_name, device):
    assert platform.name == platform_name
    assert isinstance(platform.dist_backend, str) and platform.dist_backend
    assert device.type == torch.device(platform.device_type).type


def test_device_queries(platform):
    assert platform.device_count() >= 1
    free, total = platform.memory_info(0)
    assert 0 <= free <= total and total > 0
    with pytest.raises(ValueError):
        platform.torch_device(-1)
    platform.synchronize(0)


def test_kv_cache_budget(platform):
    default = platform.kv_cache_budget_bytes(None)
    free, _total = platform.memory_info(0)
    assert 0 < default <= free, f"default KV budget {default} B is not within free memory {free} B"
    assert platform.kv_cache_budget_bytes(0.25) == 2**28
    with pytest.raises(InvalidParameterError, match="kv_cache_memory"):
        platform.kv_cache_budget_bytes(0)


def test_preferred_attention_backends_resolve(registry, platform, platform_name, caps):
    preferred = platform.preferred_attention_backends()
    assert isinstance(preferred, tuple) and all(isinstance(n, str) for n in preferred)
    backends = registry.load_all("attention_backends")
    for name in preferred:
        if name in backends:
            cls = backends[name]
            assert issubclass(cls, AttentionBackend)
            assert cls.runs_on(platform_name), f"preferred backend {name} runs on {sorted(cls.platforms)}"
            missing = cls.required_features - caps.features
            assert not missing, f"preferred backend {name} needs features {sorted(missing)} the platform lacks"
    usable = [n for n in preferred if n in backends]
    assert usable, (
        f"none of the preferred attention backends {list(preferred)} is registered "
        f"(registered: {sorted(backends)}); the platform cannot run a model"
    )


def test_platform_block_sizes_are_served(registry, platform, platform_name, caps):
    # The engine takes the platform's default block size when the user sets none: a
    # preferred backend must serve it, and each preferred backend some declared size.
    backends = registry.load_all("attention_backends")
    usable = {n: backends[n] for n in platform.preferred_attention_backends()
              if n in backends and not backends[n].required_features - caps.features}
    for name, cls in usable.items():
        common = set(cls.supported_block_sizes) & set(caps.block_sizes)
        assert common, (f"preferred backend {name} supports block sizes {sorted(cls.supported_block_sizes)}, none of "
                        f"{platform_name}'s {sorted(caps.block_sizes)}")
    if usable:
        assert any(caps.default_block_size in cls.supported_block_sizes for cls in usable.values()), (
            f"default_block_size {caps.default_block_size} is served by none of the preferred backends {sorted(usable)}")


@pytest.mark.parametrize(
    ("kind", "base", "method"),
    [("communicators", Communicator, "default_communicator"),
     ("kv_cache_allocators", KVCacheAllocator, "default_kv_cache_allocator")],
)
def test_default_components_resolve(registry, platform, platform_name, kind, base, method):
    name = getattr(platform, method)()
    assert name in registry.names(kind), f"{method}() is {name!r}, not a registered {kind}: {registry.names(kind)}"
    cls = registry.get(kind, name)
    assert issubclass(cls, base) and cls.name == name
    assert platform_name in cls.platforms, f"{name} runs on {sorted(cls.platforms)}"


def test_plan_choices_without_a_model(registry, platform):
    choices = dict(resolve_platform_choices(EngineConfig(), registry, platform))
    assert choices["communicator"].name == platform.default_communicator()
    assert choices["kv_cache_allocator"].name == platform.default_kv_cache_allocator()
    assert "default" in choices["communicator"].reason
