"""Conformance: the probe is cheap, answers for this platform, and has no side effects."""

from __future__ import annotations

import os
import time

import pytest

from portaserve.framework.interfaces import DeviceInfo, Unavailable


def test_probe_does_not_change_the_environment(platform_cls):
    before = dict(os.environ)
    for _ in range(3):
        platform_cls.probe()
    after = dict(os.environ)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"probe() changed environment variables: {changed}"


def test_probe_answers_for_this_platform(platform_cls, platform_name):
    result = platform_cls.probe()
    assert isinstance(result, (DeviceInfo, Unavailable)), f"probe() returned {result!r}"
    assert result.platform == platform_name
    assert isinstance(result.reason, str) and result.reason.strip(), "a probe must say why"
    if isinstance(result, DeviceInfo):
        assert isinstance(result.score, int)
        assert result.device_count >= 1
        assert result.total_memory_bytes > 0
        assert result.device_name
        assert result.describe()


def test_repeated_probes_agree(platform_cls):
    assert platform_cls.probe() == platform_cls.probe()


def test_probe_is_cheap(platform_cls):
    platform_cls.probe()  # first call may import the vendor runtime
    start = time.perf_counter()
    platform_cls.probe()
    assert time.perf_counter() - start < 30.0, "probe() runs on every `portaserve platforms`; keep it cheap"


def test_plugin_loaded_without_errors(registry, platform_name):
    rec = registry.record(registry.platform_plugin[platform_name])
    assert rec.loaded and rec.error is None, f"{rec.label()}: {rec.error}"


def test_probe_reason_when_unavailable(platform_cls, platform_name, registry):
    result = platform_cls.probe()
    if isinstance(result, DeviceInfo):
        pytest.skip(f"{platform_name} is available here")
    from portaserve.framework.errors import PlatformUnavailableError
    from portaserve.framework.selection import choose_platform

    with pytest.raises(PlatformUnavailableError, match="not available"):
        choose_platform(registry, platform_name, strict=False)
