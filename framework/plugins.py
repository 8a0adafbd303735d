"""Loading plugins: entry points -> an isolated, reported registry of components.

Each entry point is imported, version-checked and asked for its contributions on its
own; whatever goes wrong (import error, incompatible contract, a hook that raises or
returns the wrong type, a name clash) is recorded against that plugin, with its
distribution's name and version, and the plugin is skipped. `strict=True`
(``--strict-plugins`` or ``PORTASERVE_STRICT_PLUGINS=1``) turns any such record into a
`PluginError` at startup.

Environment:
- ``PORTASERVE_PLUGINS=a,b``: allow-list of third-party plugin names (built-ins, the
  entry points of the portaserve distribution itself, always load);
- ``PORTASERVE_DISABLE_PLUGIN_AUTOLOAD=1``: load only the built-ins;
- ``PORTASERVE_STRICT_PLUGINS=1``: same as ``--strict-plugins``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from . import hookspecs
from .errors import PluginError
from .interfaces import AttentionBackend, Communicator, KVCacheAllocator, Platform, QuantMethod
from .interfaces.ops import OpImpl, OpSpec

PLATFORM_GROUP = "portaserve.platforms"
PLUGIN_GROUP = "portaserve.plugins"
GROUPS = (PLATFORM_GROUP, PLUGIN_GROUP)
BUILTIN_DISTRIBUTION = "portaserve"
# Components of the framework itself (pure torch, vendor-free), always registered.
FRAMEWORK_PLUGIN = "portaserve.framework.builtin_components"

# hook name -> (registry kind, base class the component must subclass, or None)
_COMPONENT_HOOKS: dict[str, tuple[str, type | None]] = {
    "portaserve_attention_backends": ("attention_backends", AttentionBackend),
    "portaserve_communicators": ("communicators", Communicator),
    "portaserve_kv_cache_allocators": ("kv_cache_allocators", KVCacheAllocator),
    "portaserve_quant_methods": ("quant_methods", QuantMethod),
    "portaserve_model_architectures": ("model_architectures", None),
    "portaserve_reasoning_parsers": ("reasoning_parsers", None),
    "portaserve_tool_parsers": ("tool_parsers", None),
    "portaserve_checkpoint_writers": ("checkpoint_writers", None),
    "portaserve_structured_output_backends": ("structured_output_backends", None),
}
_BASES = {kind: base for kind, base in _COMPONENT_HOOKS.values()}
COMPONENT_KINDS = tuple(kind for kind, _ in _COMPONENT_HOOKS.values())


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True, slots=True)
class EntryPointSpec:
    """An entry point to load (a plain record, so tests can describe fake ones)."""

    name: str
    value: str  # "package.module", or "package.module:attr" naming the plugin object
    group: str
    distribution: str | None = None
    version: str | None = None

    @property
    def builtin(self) -> bool:
        return self.distribution == BUILTIN_DISTRIBUTION


@dataclass(slots=True)
class PluginRecord:
    """What happened to one plugin; shown by `portaserve platforms`."""

    name: str
    module: str
    group: str
    distribution: str | None
    version: str | None
    builtin: bool
    loaded: bool = False
    error: str | None = None
    #: Why the plugin was deliberately not loaded (allow-list, autoload disabled); not an error.
    skipped: str | None = None
    contract: str | None = None
    platform: str | None = None  # the platform name it registers, if any
    contributes: dict[str, list[str]] = field(default_factory=dict)

    def label(self) -> str:
        dist = f"{self.distribution} {self.version}" if self.distribution else "no distribution"
        return f"{self.name} ({dist})"


@dataclass(slots=True)
class Component:
    """A registered component, imported lazily when given as a "module:attr" string."""

    name: str
    kind: str
    plugin: str
    target: Any  # class, object, or "module:attr"

    def load(self) -> Any:
        if isinstance(self.target, str):
            obj = import_object(self.target)
            problem = _component_problem(self.kind, self.name, obj)
            if problem:
                raise TypeError(problem)
            self.target = obj
        return self.target


def _component_problem(kind: str, name: str, obj: Any) -> str | None:
    """Why `obj` cannot be the `kind` component called `name`, or None."""
    base = _BASES.get(kind)
    if base is None:
        return None
    if not (isinstance(obj, type) and issubclass(obj, base)):
        return f"{kind} {name!r} is {obj!r}, not a {base.__name__} subclass"
    declared = getattr(obj, "name", None)
    if declared != name:
        return f"{kind} registered as {name!r} but its class declares name {declared!r}"
    return None


def import_object(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"expected 'module:attr', got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class PluginRegistry:
    """Everything the loaded plugins contribute, with a record per plugin."""

    def __init__(self) -> None:
        self.records: list[PluginRecord] = []
        self.platforms: dict[str, type[Platform]] = {}
        self.platform_plugin: dict[str, str] = {}
        self.components: dict[str, dict[str, Component]] = {kind: {} for kind in COMPONENT_KINDS}
        self.custom_ops: list[tuple[str, OpImpl]] = []
        #: op name -> (plugin, its declaration)
        self.op_specs: dict[str, tuple[str, OpSpec]] = {}
        #: (platform name, architecture name) -> a platform's own model implementation
        self.platform_models: dict[tuple[str, str], Component] = {}

    # ----- queries ---------------------------------------------------------------------

    def failures(self) -> list[PluginRecord]:
        return [r for r in self.records if r.error is not None]

    def record(self, name: str) -> PluginRecord | None:
        return next((r for r in self.records if r.name == name), None)

    def get(self, kind: str, name: str) -> Any:
        """The component `name` of `kind` (imported if lazy); KeyError lists what exists."""
        try:
            comp = self.components[kind][name]
        except KeyError:
            known = ", ".join(sorted(self.components[kind])) or "none"
            raise KeyError(f"no {kind.replace('_', ' ')[:-1]} named {name!r}; registered: {known}") from None
        return comp.load()

    def names(self, kind: str) -> list[str]:
        return sorted(self.components[kind])

    def architecture(self, name: str, platform: str, *, generic: bool = False) -> Any:
        """The model class for architecture `name` on `platform`: the platform's own
        implementation when a plugin registered one (unless `generic`), else the generic one."""
        comp = None if generic else self.platform_models.get((platform, name))
        if comp is not None:
            return comp.load()
        return self.get("model_architectures", name)

    def architecture_names(self, platform: str) -> list[str]:
        """Every architecture that can run on `platform` (generic or its own)."""
        own = {arch for plat, arch in self.platform_models if plat == platform}
        return sorted(own | set(self.components["model_architectures"]))

    def load_all(self, kind: str) -> dict[str, Any]:
        """Every component of `kind`, imported; one that fails to import is reported and dropped."""
        out = {}
        for name, comp in list(self.components[kind].items()):
            try:
                out[name] = comp.load()
            except Exception as exc:  # an isolated plugin failure, not ours to crash on
                self._fail_component(comp, exc)
        return out

    def _fail_component(self, comp: Component, exc: BaseException) -> None:
        del self.components[comp.kind][comp.name]
        rec = self.record(comp.plugin)
        msg = f"{comp.kind} {comp.name!r} failed to import: {type(exc).__name__}: {exc}"
        if rec is not None:
            rec.error = msg if rec.error is None else f"{rec.error}; {msg}"

    def raise_if_failed(self) -> None:
        failures = self.failures()
        if failures:
            lines = "\n".join(f"  - {r.label()}: {r.error}" for r in failures)
            raise PluginError(f"{len(failures)} plugin(s) failed (strict mode):\n{lines}")


def discover_entry_points() -> list[EntryPointSpec]:
    """Every entry point in portaserve's groups, from installed distributions."""
    specs = []
    for group in GROUPS:
        for ep in metadata.entry_points(group=group):
            dist = getattr(ep, "dist", None)
            specs.append(
                EntryPointSpec(
                    name=ep.name,
                    value=ep.value,
                    group=group,
                    distribution=dist.name if dist else None,
                    version=dist.version if dist else None,
                )
            )
    # An editable and a regular install of the same distribution list the same point twice.
    seen: set[tuple[str, str, str]] = set()
    unique = []
    for spec in specs:
        key = (spec.group, spec.name, spec.value)
        if key not in seen:
            seen.add(key)
            unique.append(spec)
    return unique


def load_plugins(
    *,
    strict: bool | None = None,
    allow: Iterable[str] | None = None,
    autoload: bool | None = None,
    entry_points: Iterable[EntryPointSpec] | None = None,
) -> PluginRegistry:
    """Load every plugin into a fresh registry. Arguments default to the environment."""
    if strict is None:
        strict = env_flag("PORTASERVE_STRICT_PLUGINS")
    if allow is None:
        raw = os.environ.get("PORTASERVE_PLUGINS", "").strip()
        allow = [a.strip() for a in raw.split(",") if a.strip()] if raw else None
    allowed = set(allow) if allow is not None else None
    if autoload is None:
        autoload = not env_flag("PORTASERVE_DISABLE_PLUGIN_AUTOLOAD")

    registry = PluginRegistry()
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)

    from portaserve import __version__

    builtin_spec = EntryPointSpec("framework", FRAMEWORK_PLUGIN, PLUGIN_GROUP, BUILTIN_DISTRIBUTION, __version__)
    discovered = list(entry_points if entry_points is not None else discover_entry_points())
    # portaserve's own plugins load first, so a third-party registration under a built-in
    # name fails that plugin, never the built-ins (whatever order entry points come in).
    discovered.sort(key=lambda spec: not spec.builtin)
    specs = [builtin_spec, *discovered]
    for spec in specs:
        if not spec.builtin:
            why = None
            if not autoload:
                why = "not loaded: PORTASERVE_DISABLE_PLUGIN_AUTOLOAD=1 loads only the built-in plugins"
            elif allowed is not None and spec.name not in allowed:
                why = f"not loaded: not in the allow-list PORTASERVE_PLUGINS={','.join(sorted(allowed))}"
            if why is not None:
                registry.records.append(
                    PluginRecord(spec.name, spec.value, spec.group, spec.distribution, spec.version, False, skipped=why)
                )
                continue
        _load_one(pm, registry, spec)
    _drop_undeclared_ops(registry)
    if strict:
        registry.raise_if_failed()
    return registry


def _drop_undeclared_ops(registry: PluginRegistry) -> None:
    """Implementations of ops nobody declared fail their plugin (checked once every
    plugin has loaded, so a plugin may implement an op another one declares)."""
    known = ", ".join(sorted(registry.op_specs))
    kept = []
    for plugin, impl in registry.custom_ops:
        if impl.op in registry.op_specs:
            kept.append((plugin, impl))
            continue
        rec = registry.record(plugin)
        msg = (f"custom op {impl.name!r} implements undeclared op {impl.op!r}; declared ops: {known} "
               "(declare a new op with portaserve_op_specs)")
        if rec is not None:
            rec.error = msg if rec.error is None else f"{rec.error}; {msg}"
            contributed = rec.contributes.get("custom_ops", [])
            if f"{impl.op}:{impl.name}" in contributed:
                contributed.remove(f"{impl.op}:{impl.name}")
    registry.custom_ops = kept


def _load_one(pm: pluggy.PluginManager, registry: PluginRegistry, spec: EntryPointSpec) -> None:
    rec = PluginRecord(spec.name, spec.value, spec.group, spec.distribution, spec.version, spec.builtin)
    registry.records.append(rec)
    try:
        module = import_object(spec.value) if ":" in spec.value else importlib.import_module(spec.value)
    except BaseException as exc:  # SystemExit in a plugin must not kill us; Ctrl-C still does
        if isinstance(exc, KeyboardInterrupt):
            raise
        rec.error = f"import failed: {type(exc).__name__}: {exc}"
        return
    contract = getattr(module, "PORTASERVE_CONTRACT", None)
    rec.contract = contract
    problem = check_contract(contract)
    if problem:
        rec.error = problem
        return
    try:
        pm.register(module, name=f"{spec.group}:{spec.name}")
    except Exception as exc:
        rec.error = f"hook registration failed: {type(exc).__name__}: {exc}"
        return
    staged = _collect(pm, module, spec, rec)
    if rec.error is None:
        _commit(registry, rec, staged)
    if rec.error is None:
        rec.loaded = True
    else:
        pm.unregister(module)


def check_contract(declared: Any) -> str | None:
    """Why a plugin declaring contract `declared` cannot load here, or None."""
    ours = "%d.%d" % hookspecs.CONTRACT_VERSION
    if declared is None:
        return f"does not declare PORTASERVE_CONTRACT (portaserve's contract is {ours})"
    try:
        major, minor = (int(p) for p in str(declared).split("."))
    except ValueError:
        return f"PORTASERVE_CONTRACT {declared!r} is not 'major.minor' (portaserve's contract is {ours})"
    our_major, our_minor = hookspecs.CONTRACT_VERSION
    if major != our_major or minor > our_minor:
        return f"built for contract {declared}, but this portaserve provides contract {ours}"
    return None


def _hook_result(module: ModuleType, hook: str, rec: PluginRecord) -> Any:
    fn = getattr(module, hook, None)
    if fn is None or not hasattr(fn, "portaserve_impl"):
        return None
    try:
        return fn()
    except (Exception, SystemExit) as exc:
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        rec.error = f"hook {hook} raised {type(exc).__name__}: {exc} ({tb.filename}:{tb.lineno})"
        return None


def _collect(pm, module: ModuleType, spec: EntryPointSpec, rec: PluginRecord) -> dict[str, Any]:
    """Call each of the plugin's hooks on its own and type-check the answers."""
    staged: dict[str, Any] = {}
    known = {n for n in dir(hookspecs) if n.startswith("portaserve_")}
    for attr in dir(module):
        if hasattr(getattr(module, attr), "portaserve_impl") and attr not in known:
            rec.error = f"implements unknown hook {attr!r}; known hooks: {', '.join(sorted(known))}"
            return staged
    platform_cls = _hook_result(module, "portaserve_platform", rec)
    if platform_cls is not None:
        problem = _platform_problem(platform_cls)
        if problem:
            rec.error = f"portaserve_platform returned {problem}"
            return staged
        staged["platform"] = platform_cls
    for hook, (kind, _base) in _COMPONENT_HOOKS.items():
        result = _hook_result(module, hook, rec)
        if rec.error:
            return staged
        if result is None:
            continue
        if not isinstance(result, Mapping):
            rec.error = f"{hook} must return a mapping of name to class, got {type(result).__name__}"
            return staged
        for name, target in result.items():
            problem = None if isinstance(target, str) else _component_problem(kind, name, target)
            if not isinstance(name, str) or problem:
                rec.error = f"{hook}: {problem or f'name {name!r} is not a string'}"
                return staged
        staged[kind] = list(result.items())
    specs = _hook_result(module, "portaserve_op_specs", rec)
    if rec.error:
        return staged
    if specs is not None:
        if not isinstance(specs, Sequence) or not all(isinstance(sp, OpSpec) for sp in specs):
            rec.error = f"portaserve_op_specs must return a sequence of OpSpec, got {specs!r}"
            return staged
        staged["op_specs"] = list(specs)
    per_platform = _hook_result(module, "portaserve_platform_model_architectures", rec)
    if rec.error:
        return staged
    if per_platform is not None:
        problem = _platform_models_problem(per_platform)
        if problem:
            rec.error = f"portaserve_platform_model_architectures {problem}"
            return staged
        staged["platform_models"] = [(p, a, t) for p, archs in per_platform.items() for a, t in archs.items()]
    ops = _hook_result(module, "portaserve_custom_ops", rec)
    if rec.error:
        return staged
    if ops is not None and not isinstance(ops, Sequence):
        rec.error = f"portaserve_custom_ops must return a sequence of OpImpl, got {type(ops).__name__}"
        return staged
    if ops:
        for op in ops:
            if not isinstance(op, OpImpl):
                rec.error = f"portaserve_custom_ops returned {op!r}, not an OpImpl"
                return staged
        staged["custom_ops"] = list(ops)
    return staged


def _platform_models_problem(result: Any) -> str | None:
    if not isinstance(result, Mapping):
        return f"must return a mapping of platform name to {{architecture: class}}, got {type(result).__name__}"
    for platform, archs in result.items():
        if not isinstance(platform, str) or not isinstance(archs, Mapping):
            return f"entry {platform!r}: expected a platform name mapped to {{architecture: class}}"
        for arch, target in archs.items():
            if not isinstance(arch, str) or not (isinstance(target, (str, type))):
                return f"{platform}/{arch!r}: expected an architecture name mapped to a class or 'module:Class'"
    return None


def _platform_problem(cls: Any) -> str | None:
    """Why `cls` cannot be a platform class (checked at load time, not at first use), or None."""
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        return f"{cls!r}, not a Platform subclass"
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or name == "auto":
        return f"{cls.__name__} whose name is {name!r} (a non-empty string other than 'auto' is required)"
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        return f"{cls.__name__}, which does not implement {missing}"
    for attr in ("device_type", "dist_backend"):
        if not isinstance(getattr(cls, attr, None), str):
            return f"{cls.__name__} without a string {attr!r}"
    return None


def _same_target(existing: Any, new: Any) -> bool:
    """Whether two registrations name the same component (a class, or its "module:Class" path)."""
    if existing is new or existing == new:
        return True

    def as_path(target: Any) -> str:
        if isinstance(target, str):
            return target
        return f"{getattr(target, '__module__', '')}:{getattr(target, '__qualname__', '')}"

    return as_path(existing) == as_path(new)


def _commit(registry: PluginRegistry, rec: PluginRecord, staged: dict[str, Any]) -> None:
    """Add a plugin's contributions, unless one clashes with another plugin's."""
    platform_cls = staged.get("platform")
    if platform_cls is not None:
        name = platform_cls.name
        other = registry.platform_plugin.get(name)
        if other is not None and registry.platforms[name] is not platform_cls:
            rec.error = f"platform name {name!r} is already registered by plugin {other!r}"
            return
    for kind in COMPONENT_KINDS:
        for name, target in staged.get(kind, []):
            existing = registry.components[kind].get(name)
            if existing is not None and not _same_target(existing.target, target):
                rec.error = f"{kind[:-1].replace('_', ' ')} {name!r} is already registered by plugin {existing.plugin!r}"
                return
    for sp in staged.get("op_specs", []):
        other = registry.op_specs.get(sp.name)
        if other is not None and not _same_target(other[1].reference, sp.reference):
            rec.error = f"op {sp.name!r} is already declared by plugin {other[0]!r}"
            return
    for platform, arch, target in staged.get("platform_models", []):
        existing = registry.platform_models.get((platform, arch))
        if existing is not None and not _same_target(existing.target, target):
            rec.error = f"model architecture {arch!r} for platform {platform!r} is already registered by plugin {existing.plugin!r}"
            return
    if platform_cls is not None:
        registry.platforms[platform_cls.name] = platform_cls
        registry.platform_plugin.setdefault(platform_cls.name, rec.name)
        rec.platform = platform_cls.name
    for kind in COMPONENT_KINDS:
        for name, target in staged.get(kind, []):
            registry.components[kind].setdefault(name, Component(name, kind, rec.name, target))
            rec.contributes.setdefault(kind, []).append(name)
    for sp in staged.get("op_specs", []):
        registry.op_specs.setdefault(sp.name, (rec.name, sp))
        rec.contributes.setdefault("op_specs", []).append(sp.name)
    for platform, arch, target in staged.get("platform_models", []):
        registry.platform_models.setdefault((platform, arch), Component(arch, "model_architectures", rec.name, target))
        rec.contributes.setdefault("platform_model_architectures", []).append(f"{platform}:{arch}")
    for op in staged.get("custom_ops", []):
        registry.custom_ops.append((rec.name, op))
        rec.contributes.setdefault("custom_ops", []).append(f"{op.op}:{op.name}")


_DEFAULT_REGISTRY: PluginRegistry | None = None


def get_registry(*, strict: bool | None = None) -> PluginRegistry:
    """The process-wide registry, loaded on first use (strictness checked on every call)."""
    global _DEFAULT_REGISTRY
    if _DEFAULT_REGISTRY is None:
        _DEFAULT_REGISTRY = load_plugins(strict=False)
    if strict or (strict is None and env_flag("PORTASERVE_STRICT_PLUGINS")):
        _DEFAULT_REGISTRY.raise_if_failed()
    return _DEFAULT_REGISTRY


def reset_registry() -> None:
    """Forget the process-wide registry (tests that change the environment)."""
    global _DEFAULT_REGISTRY
    _DEFAULT_REGISTRY = None
