"""The platform the kit checks, resolved once per pytest session.

Collection needs it as much as the tests do: the attention, op and quant-method grids are
built from what the platform declares (block sizes, dtypes, KV dtypes, features), which
only an instance answers. `resolve` probes and instantiates the platform at most once
per session and keeps why it could not (not registered, probe raised, unavailable), so
every module reports the same reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

#: Appended to the failure when the platform is unavailable and --allow-unavailable is off.
UNAVAILABLE_HINT = (
    "the conformance kit fails where the platform under test is unavailable, so a CI job on the "
    "wrong machine is never green; run it where the device is, or pass --allow-unavailable to skip "
    "the device checks"
)


@dataclass(slots=True)
class PlatformUnderTest:
    """The platform's name, class, instance (None when it could not be built) and why not."""

    name: str
    registry: Any  # PluginRegistry
    cls: Any = None  # type[Platform] | None
    instance: Any = None  # Platform | None
    #: Why there is no instance: "not registered ...", "probe raised ...", the probe's reason.
    problem: str | None = None
    #: True when the probe answered Unavailable (the one case --allow-unavailable skips).
    unavailable: bool = False

    def capabilities(self):
        """The instance's `PlatformCapabilities`, or None without an instance."""
        return None if self.instance is None else self.instance.capabilities()

    def require(self, config) -> Any:
        """The instance; otherwise fail the calling test (skip if unavailable and allowed)."""
        if self.instance is not None:
            return self.instance
        if self.unavailable and option(config, "--allow-unavailable"):
            pytest.skip(f"{self.problem} (--allow-unavailable)")
        if self.unavailable:
            pytest.fail(f"{self.problem}: {UNAVAILABLE_HINT}", pytrace=False)
        pytest.fail(self.problem or f"platform {self.name!r} could not be instantiated", pytrace=False)


def option(config, name: str, default: Any = None) -> Any:
    """A kit option, or `default` when the pytest11 plugin is disabled (-p no:portaserve)."""
    try:
        return config.getoption(name, default=default)
    except ValueError:
        return default


def selected_platform_name(config) -> str:
    """--platform, else PORTASERVE_DEVICE, else the platform `--device auto` selects."""
    name = option(config, "--platform") or os.environ.get("PORTASERVE_DEVICE", "").strip()
    if name and name != "auto":
        return name
    from portaserve.framework.plugins import get_registry
    from portaserve.framework.selection import choose_platform

    return choose_platform(get_registry(), "auto", strict=False).platform_cls.name


_KEY = pytest.StashKey[PlatformUnderTest]()


def resolve(config) -> PlatformUnderTest:
    """The session's platform under test (probed and instantiated on first call)."""
    put = config.stash.get(_KEY, None)
    if put is None:
        put = _resolve(selected_platform_name(config))
        config.stash[_KEY] = put
    return put


def resolved(config) -> PlatformUnderTest | None:
    """The platform under test if `resolve` ran in this session (the summary's view)."""
    return config.stash.get(_KEY, None)


def _resolve(name: str) -> PlatformUnderTest:
    from portaserve.framework.errors import PlatformUnavailableError
    from portaserve.framework.interfaces import Unavailable
    from portaserve.framework.plugins import get_registry
    from portaserve.framework.selection import choose_platform

    registry = get_registry()
    put = PlatformUnderTest(name, registry, registry.platforms.get(name))
    if put.cls is None:
        rec = registry.record(name)
        why = f": {rec.error or rec.skipped}" if rec is not None and (rec.error or rec.skipped) else ""
        put.problem = f"platform {name!r} is not registered{why}; registered: {sorted(registry.platforms)}"
        return put
    # Probe directly first: a probe that raises is a plugin bug, never an "unavailable" skip.
    try:
        answer = put.cls.probe()
    except Exception as exc:
        put.problem = f"{name}.probe() raised {type(exc).__name__}: {exc}"
        return put
    if isinstance(answer, Unavailable):
        put.problem, put.unavailable = f"device {name!r} is not available: {answer.reason}", True
        return put
    try:
        put.instance = choose_platform(registry, name, strict=False).instantiate()
    except PlatformUnavailableError as exc:
        put.problem, put.unavailable = str(exc), True
    except Exception as exc:
        put.problem = f"platform {name!r} could not be instantiated: {type(exc).__name__}: {exc}"
    return put
