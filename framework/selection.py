"""Choosing the platform: probe every registered platform, pick by score or by name.

`--device auto` tries the available platforms from the highest score down (an
accelerator beats the CPU) and takes the first that can serve the model (dtype, head
size, block size, quantization: the caller's `can_serve` check); the plan lists why each
higher-scored one was passed over. Two servable platforms sharing the best score is an
error that lists them. A forced `--device NAME` that is unavailable fails with the
probe's reason (and one that cannot serve the model, with the plan's).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from .errors import PlatformUnavailableError, PluginError, UnsupportedError
from .interfaces import DeviceInfo, Platform, Unavailable
from .plugins import PluginRegistry, env_flag


@dataclass(frozen=True, slots=True)
class ProbeReport:
    """One platform's probe answer (or the error its probe raised)."""

    platform: str
    plugin: str
    result: DeviceInfo | Unavailable
    error: str | None = None  # the probe raised (a plugin defect, reported, not fatal)

    @property
    def available(self) -> bool:
        return isinstance(self.result, DeviceInfo)


@dataclass(frozen=True, slots=True)
class PlatformChoice:
    platform_cls: type[Platform]
    device: DeviceInfo
    reason: str
    rejected: tuple[tuple[str, str], ...]
    reports: tuple[ProbeReport, ...]

    def instantiate(self) -> Platform:
        return self.platform_cls(self.device)


def probe_all(registry: PluginRegistry) -> list[ProbeReport]:
    """Probe every registered platform; a probe that raises is reported on its plugin."""
    reports = []
    for name, cls in sorted(registry.platforms.items()):
        plugin = registry.platform_plugin[name]
        try:
            result = cls.probe()
            if not isinstance(result, (DeviceInfo, Unavailable)):
                raise TypeError(f"probe() returned {result!r}, not DeviceInfo or Unavailable")
            if result.platform != name:
                raise ValueError(f"probe() answered for platform {result.platform!r}, not {name!r}")
            reports.append(ProbeReport(name, plugin, result))
        except (Exception, SystemExit) as exc:  # a plugin's defect must not end the process
            msg = f"probe raised {type(exc).__name__}: {exc}"
            rec = registry.record(plugin)
            if rec is not None and msg not in (rec.error or ""):  # probed again: report once
                rec.error = msg if rec.error is None else f"{rec.error}; {msg}"
            reports.append(ProbeReport(name, plugin, Unavailable(name, msg), error=msg))
    return reports


def requested_device(device: str | None) -> str:
    """The device asked for: a platform name given as argument, else `PORTASERVE_DEVICE`, else "auto".

    "auto" (the default of ``--device``) defers to ``PORTASERVE_DEVICE`` when it is set, so the
    variable works without touching the command line.
    """
    device = (device or "").strip()
    if device and device != "auto":
        return device
    return os.environ.get("PORTASERVE_DEVICE", "").strip() or "auto"


def choose_platform(
    registry: PluginRegistry,
    device: str | None = None,
    *,
    strict: bool | None = None,
    can_serve: Callable[[PlatformChoice], str | None] | None = None,
) -> PlatformChoice:
    """Pick the platform for `device` ("auto" or a platform name).

    :param strict: a probe that raises is fatal (``--strict-plugins``); None reads
        ``PORTASERVE_STRICT_PLUGINS``.
    :param can_serve: for "auto": why a candidate cannot serve the model, or None when it
        can (the engine resolves the plan there); None takes the best score unchecked.
    """
    device = requested_device(device)
    if strict is None:
        strict = env_flag("PORTASERVE_STRICT_PLUGINS")
    reports = probe_all(registry)
    if strict:
        failed = [r for r in reports if r.error]
        if failed:
            lines = "; ".join(f"{r.platform} ({r.plugin}): {r.error}" for r in failed)
            raise PluginError(f"platform probe failed (strict mode): {lines}")
    by_name = {r.platform: r for r in reports}
    if device != "auto":
        report = by_name.get(device)
        if report is None:
            known = ", ".join(["auto", *sorted(by_name)])
            raise UnsupportedError(f"device: unknown device {device!r}; choose one of: {known}")
        if not report.available:
            raise PlatformUnavailableError(f"device {device!r} is not available: {report.result.reason}")
        rejected = tuple((r.platform, "not requested (--device %s)" % device) for r in reports if r.platform != device)
        return PlatformChoice(registry.platforms[device], report.result, f"forced with --device {device}", rejected, tuple(reports))

    available = [r for r in reports if r.available]
    if not available:
        reasons = "; ".join(f"{r.platform}: {r.result.reason}" for r in reports) or "no platform plugin is registered"
        raise PlatformUnavailableError(f"no platform is available ({reasons})")
    passed_over: list[tuple[str, str]] = []
    for score in sorted({r.result.score for r in available}, reverse=True):
        group = [r for r in available if r.result.score == score]
        servable = []
        for r in group:
            why = None
            if can_serve is not None:
                choice = PlatformChoice(registry.platforms[r.platform], r.result, "", (), tuple(reports))
                why = can_serve(choice)
            if why is None:
                servable.append(r)
            else:
                passed_over.append((r.platform, f"score {score}, but cannot serve the model: {why}"))
        if len(servable) > 1:
            names = ", ".join(f"{r.platform} ({r.result.describe()})" for r in servable)
            raise UnsupportedError(
                f"device: --device auto found {len(servable)} platforms with the same score {score}: {names}; "
                f"choose one with --device NAME (or PORTASERVE_DEVICE=NAME)"
            )
        if servable:
            winner = servable[0]
            break
    else:
        detail = "; ".join(f"{name}: {why}" for name, why in passed_over)
        raise UnsupportedError(f"device: no available platform can serve the model ({detail})")
    rejected = list(passed_over)
    for r in reports:
        if r is winner or any(r.platform == name for name, _ in passed_over):
            continue
        why = f"lower score {r.result.score} < {winner.result.score}" if r.available else f"unavailable: {r.result.reason}"
        rejected.append((r.platform, why))
    reason = f"highest score {winner.result.score} among available platforms: {winner.result.reason}"
    if passed_over:
        reason = f"highest-scored available platform that can serve the model (score {winner.result.score}): {winner.result.reason}"
    return PlatformChoice(registry.platforms[winner.platform], winner.result, reason, tuple(rejected), tuple(reports))
