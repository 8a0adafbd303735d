"""The one-page summary at the end of a kit run: what the platform declares and
contributes, and what passed, module by module.

A vendor's CI log then says in one place which plugin (and version) was certified, on
which device, with which block sizes, dtypes and components, and where the skips are.
"""

from __future__ import annotations

from collections.abc import Mapping

from portaserve.framework.testing.platform_under_test import PlatformUnderTest

_OUTCOME_ORDER = ("passed", "failed", "error", "skipped")


def _dtype_names(dtypes) -> str:
    return " ".join(str(d).removeprefix("torch.") for d in dtypes) or "(none)"


def _sorted_dtypes(dtypes) -> list:
    return sorted(dtypes, key=str)


def _listing(items: list[str]) -> str:
    return ", ".join(items) if items else "(none)"


def contributions(put: PlatformUnderTest) -> list[tuple[str, str]]:
    """(what, names) for every kind of component that runs on the platform.

    Components come from any plugin that declares the platform; one contributed by
    another plugin than the platform's own is marked with that plugin's name.
    """
    registry, name = put.registry, put.name
    own = registry.platform_plugin.get(name)

    def mark(plugin: str) -> str:
        return "" if plugin == own else f" [from {plugin}]"

    rows: list[tuple[str, str]] = []
    for kind, label, default in (
        ("attention_backends", "attention backends", None),
        ("kv_cache_allocators", "KV-cache allocators", "default_kv_cache_allocator"),
        ("communicators", "communicators", "default_communicator"),
    ):
        chosen = getattr(put.instance, default)() if default and put.instance is not None else None
        preferred = put.instance.preferred_attention_backends() if put.instance is not None else ()
        items = []
        for comp_name, cls in sorted(registry.load_all(kind).items()):
            declared = getattr(cls, "platforms", ())
            if declared is not None and name not in declared:  # None: any platform with its features
                continue
            notes = []
            if comp_name == chosen:
                notes.append("default")
            if kind == "attention_backends":
                if comp_name in preferred:
                    notes.append(f"preferred #{preferred.index(comp_name) + 1}")
                notes.append(f"KV block dim {cls.kv_cache_block_dim}")
                if cls.required_features:
                    notes.append(f"needs {' '.join(sorted(cls.required_features))}")
            plugin = registry.components[kind][comp_name].plugin
            items.append(f"{comp_name} ({', '.join(notes)}){mark(plugin)}" if notes else f"{comp_name}{mark(plugin)}")
        rows.append((label, _listing(items)))
    ops = []
    for plugin, impl in registry.custom_ops:
        if name in impl.platforms:
            needs = f" (needs {' '.join(sorted(impl.required_features))})" if impl.required_features else ""
            ops.append(f"{impl.op}:{impl.name}{needs}{mark(plugin)}")
    rows.append(("ops", _listing(ops)))
    rows.append(("op specs declared", _listing(sorted(op for op, (plugin, _) in registry.op_specs.items() if plugin == own))))
    methods = []
    for method_name, cls in sorted(registry.load_all("quant_methods").items()):
        plugin = registry.components["quant_methods"][method_name].plugin
        platforms = getattr(cls, "platforms", None)
        if plugin == own or (platforms is not None and name in platforms):
            variant = f" (variant of {cls.variant_of})" if getattr(cls, "variant_of", None) else ""
            methods.append(f"{method_name}{variant}{mark(plugin)}")
    rows.append(("quant methods", _listing(methods)))
    models = sorted(f"{arch}{mark(comp.plugin)}" for (plat, arch), comp in registry.platform_models.items() if plat == name)
    rows.append(("platform models", _listing(models)))
    return rows


def summary_lines(put: PlatformUnderTest, outcomes: Mapping[str, Mapping[str, int]], *, allow_unavailable: bool) -> list[str]:
    """The summary as lines of text (the kit's conftest writes them to the terminal)."""
    registry, name = put.registry, put.name
    lines = [f"portaserve conformance kit: platform {name}"]
    plugin = registry.platform_plugin.get(name)
    rec = registry.record(plugin) if plugin else None
    if rec is not None:
        lines.append(f"  plugin: {rec.label()}, contract {rec.contract or '(undeclared)'}")
    if put.instance is not None:
        lines.append(f"  device: {put.instance.info.describe()}; {put.instance.info.reason}")
    elif put.unavailable:
        verdict = "device checks SKIPPED (--allow-unavailable)" if allow_unavailable else "device checks FAILED"
        lines.append(f"  device: UNAVAILABLE, {put.problem}; {verdict}")
    else:
        lines.append(f"  device: none: {put.problem}")
    caps = put.capabilities()
    if caps is not None:
        preferred = f" (preferred: {_dtype_names(caps.preferred_dtypes)})" if caps.preferred_dtypes else ""
        lines.append(
            f"  declares: block sizes {sorted(caps.block_sizes)} (default {caps.default_block_size}); "
            f"dtypes {_dtype_names(_sorted_dtypes(caps.dtypes))}{preferred}; KV dtypes {' '.join(sorted(caps.kv_cache_dtypes))}"
        )
        lines.append(f"  features: {' '.join(sorted(caps.features)) or '(none)'}; "
                     f"ranks share a device: {'yes' if put.instance.ranks_share_device else 'no'}")
    if put.cls is not None:
        lines.append("  contributes:")
        lines.extend(f"    {what}: {names}" for what, names in contributions(put))
    lines.append("  results:")
    total: dict[str, int] = {}
    width = max((len(m) for m in outcomes), default=0)
    for module in sorted(outcomes):
        counts = outcomes[module]
        for outcome, n in counts.items():
            total[outcome] = total.get(outcome, 0) + n
        lines.append(f"    {module:<{width}}  {_counts(counts)}")
    lines.append(f"    {'total':<{width}}  {_counts(total)}")
    return lines


def _counts(counts: Mapping[str, int]) -> str:
    parts = [f"{counts[o]} {o}" for o in _OUTCOME_ORDER if counts.get(o)]
    return ", ".join(parts) or "nothing ran"
