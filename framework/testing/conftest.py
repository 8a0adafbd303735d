"""Fixtures of the conformance kit, shared by every check module in this package."""

from __future__ import annotations

import os

import pytest


def selected_platform_name(config) -> str:
    """--platform, else PORTASERVE_DEVICE, else the platform `--device auto` selects."""
    try:
        name = config.getoption("--platform", default=None)
    except ValueError:  # the pytest11 plugin is disabled
        name = None
    name = name or os.environ.get("PORTASERVE_DEVICE", "").strip()
    if name and name != "auto":
        return name
    from portaserve.framework.plugins import get_registry
    from portaserve.framework.selection import choose_platform

    return choose_platform(get_registry(), "auto", strict=False).platform_cls.name


_TESTED_KEY = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    name = config.stash.get(_TESTED_KEY, None)
    if name is not None:
        terminalreporter.write_line(f"portaserve conformance kit: platform {name}")


@pytest.fixture(scope="session")
def platform_name(request) -> str:
    name = selected_platform_name(request.config)
    request.config.stash[_TESTED_KEY] = name
    return name


@pytest.fixture(scope="session")
def registry():
    """The process-wide plugin registry (lenient: other plugins' failures are not this one's)."""
    from portaserve.framework.plugins import get_registry

    return get_registry()


@pytest.fixture(scope="session")
def platform_cls(registry, platform_name):
    cls = registry.platforms.get(platform_name)
    if cls is None:
        rec = registry.record(platform_name)
        why = f": {rec.error or rec.skipped}" if rec is not None and (rec.error or rec.skipped) else ""
        pytest.fail(f"platform {platform_name!r} is not registered{why}; registered: {sorted(registry.platforms)}")
    return cls


@pytest.fixture(scope="session")
def platform(registry, platform_cls, platform_name):
    """The platform instance, chosen as `--device NAME` would; skips when the device is unavailable."""
    from portaserve.framework.errors import PlatformUnavailableError
    from portaserve.framework.selection import choose_platform

    try:
        choice = choose_platform(registry, platform_name, strict=False)
    except PlatformUnavailableError as exc:
        pytest.skip(str(exc))
    return choice.instantiate()


@pytest.fixture(scope="session")
def device(platform):
    """The torch device of local rank 0."""
    return platform.torch_device(0)
