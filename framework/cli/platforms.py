"""`portaserve platforms [--json] [--device NAME]`: what every installed plugin contributes,
what every platform's probe answered, and what `--device` would select.

Plugins are always loaded leniently here so that a broken one can be shown; with
``--strict-plugins`` (or ``PORTASERVE_STRICT_PLUGINS=1``) a failure still makes the exit
status 1. The exit status is also 1 when the device cannot be selected.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and the plugins load when the command runs, not for `portaserve --help`
    from portaserve.framework.plugins import PluginRecord, PluginRegistry


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "platforms",
        help="list platform plugins, their probes, and the platform --device would select",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--json", action="store_true", help="print one machine-readable JSON document")
    p.add_argument(
        "--device", default=None,
        help="'auto' (default; PORTASERVE_DEVICE when set) or a platform name: the selection to show",
    )
    p.add_argument(
        "--strict-plugins", action="store_true", default=None,
        help="exit with status 1 when any plugin failed (also PORTASERVE_STRICT_PLUGINS=1)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from portaserve.framework.plugins import env_flag, load_plugins

    registry = load_plugins(strict=False)
    doc = collect(registry, args.device)
    strict = args.strict_plugins or (args.strict_plugins is None and env_flag("PORTASERVE_STRICT_PLUGINS"))
    doc["strict_plugins"] = bool(strict)
    if args.json:
        json.dump(doc, sys.stdout, indent=2, sort_keys=False)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(doc))
    failed = strict and any(p["error"] for p in doc["plugins"])
    return 1 if failed or doc["selection"]["error"] else 0


# ----- the document --------------------------------------------------------------------------


def collect(registry: PluginRegistry, device: str | None = None) -> dict[str, Any]:
    """Everything `portaserve platforms` shows, as plain JSON-able data."""
    import torch

    from portaserve import __version__
    from portaserve.framework import hookspecs
    from portaserve.framework.selection import probe_all, requested_device

    reports = probe_all(registry)  # first, so probe errors land on the plugin records below
    platforms = [_platform_entry(registry, r) for r in reports]
    selection = _selection(registry, requested_device(device))
    return {
        "portaserve": __version__,
        "contract": "%d.%d" % hookspecs.CONTRACT_VERSION,
        "torch": torch.__version__,
        "plugins": [_plugin_entry(rec) for rec in registry.records],
        "platforms": platforms,
        "selection": selection,
    }


def _plugin_entry(rec: PluginRecord) -> dict[str, Any]:
    # failed: not loaded (import, contract, hooks); error: loaded, but its probe or a lazy component failed
    if rec.error:
        status = "error" if rec.loaded else "failed"
    else:
        status = "loaded" if rec.loaded else "skipped"
    return {
        "name": rec.name,
        "status": status,
        "loaded": rec.loaded,
        "error": rec.error,
        "skipped": rec.skipped,
        "group": rec.group,
        "module": rec.module,
        "distribution": rec.distribution,
        "version": rec.version,
        "builtin": rec.builtin,
        "contract": rec.contract,
        "platform": rec.platform,
        "contributes": {k: list(v) for k, v in rec.contributes.items()},
    }


def _platform_entry(registry: PluginRegistry, report) -> dict[str, Any]:
    from portaserve.framework.interfaces import DeviceInfo

    result = report.result
    entry: dict[str, Any] = {
        "name": report.platform,
        "plugin": report.plugin,
        "available": report.available,
        "reason": result.reason,
        "error": report.error,
        "device": None,
    }
    if isinstance(result, DeviceInfo):
        entry["device"] = {
            "name": result.device_name,
            "count": result.device_count,
            "total_memory_bytes": result.total_memory_bytes,
            "capability": result.capability,
            "score": result.score,
            "extra": dict(result.extra),
        }
        try:
            platform = registry.platforms[report.platform](result)
            caps = platform.capabilities()
            entry["capabilities"] = {
                "dtypes": sorted(str(d).removeprefix("torch.") for d in caps.dtypes),
                "kv_cache_dtypes": sorted(caps.kv_cache_dtypes),
                "features": sorted(caps.features),
                "compile_backends": dict(caps.compile_backends),
                "default_compilation_mode": caps.default_compilation_mode,
                "serving_prefill_cap": caps.serving_prefill_cap,
                "block_sizes": sorted(caps.block_sizes),
                "default_block_size": caps.default_block_size,
                "preferred_dtypes": [str(d).removeprefix("torch.") for d in caps.preferred_dtypes],
            }
            entry["warnings"] = default_warnings(registry, platform)
            entry["preferred_attention_backends"] = list(platform.preferred_attention_backends())
            entry["default_communicator"] = platform.default_communicator()
            entry["default_kv_cache_allocator"] = platform.default_kv_cache_allocator()
        except Exception as exc:  # a defect of that plugin: shown, not fatal here
            entry["error"] = f"capabilities raised {type(exc).__name__}: {exc}"
    return entry


def default_warnings(registry: PluginRegistry, platform) -> list[str]:
    """What stops `platform` from serving with the engine's defaults (no flags): its default
    block size unserved by its attention backends, the default KV dtype unsupported, or a
    default component missing. Empty when an engine can start there without flags."""
    caps = platform.capabilities()
    out = []
    if "auto" not in caps.kv_cache_dtypes:
        out.append(f"kv_cache_dtypes {sorted(caps.kv_cache_dtypes)} lack the default 'auto'")
    backends = {}
    for name, cls in registry.load_all("attention_backends").items():
        if cls.runs_on(platform.name) and not cls.required_features - caps.features:
            backends[name] = cls
    serving = [n for n, cls in backends.items() if caps.default_block_size in cls.supported_block_sizes]
    if not backends:
        out.append("no attention backend is registered for it")
    elif not serving:
        sizes = "; ".join(f"{n}: {sorted(c.supported_block_sizes)}" for n, c in sorted(backends.items()))
        out.append(f"its default block size {caps.default_block_size} is served by none of its attention backends ({sizes})")
    for kind, wanted in (("kv_cache_allocators", platform.default_kv_cache_allocator()),
                         ("communicators", platform.default_communicator())):
        cls = registry.load_all(kind).get(wanted)
        if cls is None or platform.name not in cls.platforms:
            out.append(f"its default {kind[:-1].replace('_', ' ')} {wanted!r} is not registered for it")
    return out


def _choice(choice) -> dict[str, Any]:
    return {"name": choice.name, "reason": choice.reason, "rejected": [list(r) for r in choice.rejected]}


def _selection(registry: PluginRegistry, device: str) -> dict[str, Any]:
    from portaserve.framework.config import EngineConfig
    from portaserve.framework.plan import attention_candidates, resolve_platform_choices
    from portaserve.framework.selection import choose_platform

    out: dict[str, Any] = {"device": device, "selected": None, "reason": None, "rejected": [], "error": None, "plan": None}
    try:
        choice = choose_platform(registry, device, strict=False)
    except (ValueError, RuntimeError) as exc:
        out["error"] = str(exc)
        return out
    out["selected"] = choice.platform_cls.name
    out["reason"] = choice.reason
    out["rejected"] = [list(r) for r in choice.rejected]
    try:
        platform = choice.instantiate()
        plan = {label: _choice(c) for label, c in resolve_platform_choices(EngineConfig(), registry, platform)}
        plan["attention_candidates"] = [_choice(c) for c in attention_candidates(registry, platform)]
        out["plan"] = plan
    except (ValueError, RuntimeError, TypeError, ImportError) as exc:
        out["error"] = f"{choice.platform_cls.name}: {exc}"
    return out


# ----- text ----------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def render(doc: dict[str, Any]) -> str:
    lines = [f"portaserve {doc['portaserve']} (plugin contract {doc['contract']}, torch {doc['torch']})", "", "Plugins:"]
    w = max([len(p["name"]) for p in doc["plugins"]] + [8])
    for p in doc["plugins"]:
        dist = f"{p['distribution']} {p['version'] or ''}".strip() if p["distribution"] else "no distribution"
        lines.append(f"  {p['name']:<{w}}  {p['status']:<7} {dist}{' (built-in)' if p['builtin'] else ''}")
        if p["error"]:
            lines.append(f"  {'':<{w}}  error: {p['error']}")
        elif p["skipped"]:
            lines.append(f"  {'':<{w}}  {p['skipped']}")
        parts = [f"platform {p['platform']}"] if p["platform"] else []
        parts += [f"{kind.replace('_', ' ')}: {', '.join(names)}" for kind, names in p["contributes"].items()]
        if parts and p["loaded"]:
            lines.append(f"  {'':<{w}}  contributes {'; '.join(parts)}")
    lines += ["", "Platforms:"]
    w = max([len(p["name"]) for p in doc["platforms"]] + [6])
    for p in doc["platforms"]:
        if p["available"]:
            d = p["device"]
            cap = f", {d['capability']}" if d["capability"] else ""
            lines.append(
                f"  {p['name']:<{w}}  available    score {d['score']:<4} "
                f"{d['count']} x {d['name']} ({_gib(d['total_memory_bytes'])}{cap})"
            )
            lines.append(f"  {'':<{w}}  {p['reason']}")
            caps = p.get("capabilities")
            if caps:
                lines.append(
                    f"  {'':<{w}}  dtypes {', '.join(caps['dtypes'])}; kv cache {', '.join(caps['kv_cache_dtypes'])}; "
                    f"features {', '.join(caps['features']) or '-'}; block sizes "
                    f"{', '.join(map(str, caps['block_sizes']))} (default {caps['default_block_size']})"
                )
            for warning in p.get("warnings", []):
                lines.append(f"  {'':<{w}}  warning: cannot serve the engine's defaults: {warning}")
        else:
            lines.append(f"  {p['name']:<{w}}  unavailable  {p['reason']}")
        if p["error"] and p["error"] != p["reason"]:
            lines.append(f"  {'':<{w}}  error: {p['error']}")
    sel = doc["selection"]
    lines.append("")
    if sel["error"] and not sel["selected"]:
        lines.append(f"--device {sel['device']}: error: {sel['error']}")
    else:
        lines.append(f"--device {sel['device']} selects {sel['selected']}: {sel['reason']}")
        for name, why in sel["rejected"]:
            lines.append(f"  not {name}: {why}")
        if sel["plan"]:
            for label in ("kv_cache_allocator", "communicator", "compilation"):
                c = sel["plan"][label]
                lines.append(f"  {label:<19} {c['name']}  ({c['reason']})")
            cands = sel["plan"]["attention_candidates"]
            lines.append("  attention backends  " + ("; ".join(f"{c['name']} ({c['reason']})" for c in cands) or "none registered"))
        if sel["error"]:
            lines.append(f"  error: {sel['error']}")
    return "\n".join(lines) + "\n"
