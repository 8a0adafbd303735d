"""Plugin isolation: every way a plugin can be broken is reported against it (name,
distribution, version, error) and skipped, while the other plugins load; strict mode
makes any report fatal. Fake plugins are real modules written to tmp_path."""

from __future__ import annotations

import itertools
import sys
import textwrap

import pytest

from portaserve.framework.errors import PluginError
from portaserve.framework.plugins import (
    PLATFORM_GROUP,
    PLUGIN_GROUP,
    EntryPointSpec,
    get_registry,
    load_plugins,
    reset_registry,
)

pytestmark = pytest.mark.usefixtures("plugin_env")

HEADER = """
from portaserve.framework.hookspecs import hookimpl
from portaserve.framework.distributed import TorchDistributedCommunicator
from portaserve.framework.interfaces import Platform, PlatformCapabilities, DeviceInfo
import torch
"""

GOOD_PLATFORM = """
PORTASERVE_CONTRACT = "1.0"


class P(Platform):
    name = "{platform}"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def probe(cls):
        return DeviceInfo(cls.name, "fake", 1, 2**30, -5, "always")

    def capabilities(self):
        return PlatformCapabilities(dtypes=frozenset({{torch.float32}}), kv_cache_dtypes=frozenset({{"auto"}}))

    def _torch_device(self, local_rank):
        return torch.device("cpu")

    def _memory_info(self, local_rank):
        return (2**30, 2**30)


class Comm(TorchDistributedCommunicator):
    name = "{platform}_comm"
    platforms = frozenset({{"{platform}"}})
    dist_backend = "gloo"


@hookimpl
def portaserve_platform():
    return P


@hookimpl
def portaserve_communicators():
    return {{"{platform}_comm": Comm}}
"""

_counter = itertools.count()


class Plugins:
    """Writes fake plugin modules and describes them as entry points."""

    def __init__(self, tmp_path, monkeypatch):
        self.dir = tmp_path
        self.monkeypatch = monkeypatch
        monkeypatch.syspath_prepend(str(tmp_path))
        self.modules: list[str] = []

    def add(self, name: str, source: str, *, group: str = PLATFORM_GROUP, dist: str | None = None,
            version: str = "1.2.3", header: bool = True, attr: str | None = None) -> EntryPointSpec:
        module = f"fake_plugin_{name}_{next(_counter)}"
        text = (HEADER if header else "") + textwrap.dedent(source)
        (self.dir / f"{module}.py").write_text(text)
        self.modules.append(module)
        value = f"{module}:{attr}" if attr else module
        return EntryPointSpec(name, value, group, dist or f"portaserve-{name}", version)

    def good(self, name: str, platform: str | None = None, **kw) -> EntryPointSpec:
        return self.add(name, GOOD_PLATFORM.format(platform=platform or name), **kw)

    def cleanup(self):
        for module in self.modules:
            sys.modules.pop(module, None)


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    p = Plugins(tmp_path, monkeypatch)
    yield p
    p.cleanup()


CPU_BUILTIN = EntryPointSpec("cpu", "portaserve.platforms.cpu", PLATFORM_GROUP, "portaserve", "0.1.0")


def _failed(registry, name):
    rec = registry.record(name)
    assert rec is not None, f"no record for {name}"
    assert not rec.loaded and rec.error, f"{name} should have failed: {rec}"
    assert name not in registry.platforms
    return rec


def _assert_no_contribution(registry, name):
    for kind, comps in registry.components.items():
        assert not [c for c in comps.values() if c.plugin == name], f"{name} still contributes {kind}"


# ----- one broken plugin never stops the others ----------------------------------------------


def test_good_plugin_loads_and_contributes(plugins):
    spec = plugins.good("alpha")
    registry = load_plugins(entry_points=[spec])
    rec = registry.record("alpha")
    assert rec.loaded and rec.error is None and rec.contract == "1.0"
    assert rec.platform == "alpha" and rec.contributes == {"communicators": ["alpha_comm"]}
    assert registry.platforms["alpha"].name == "alpha"
    assert registry.get("communicators", "alpha_comm").platforms == frozenset({"alpha"})
    # The framework's own components always load first.
    assert registry.records[0].name == "framework" and registry.records[0].builtin


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("raise ImportError('libfoo.so.3: cannot open shared object file')",
         "import failed: ImportError: libfoo.so.3: cannot open shared object file"),
        ("import portaserve_no_such_dependency", "import failed: ModuleNotFoundError: No module named 'portaserve_no_such_dependency'"),
        ("1 / 0", "import failed: ZeroDivisionError: division by zero"),
        ("raise SystemExit(3)", "import failed: SystemExit: 3"),
    ],
)
def test_import_error_is_reported_and_the_rest_loads(plugins, source, expected):
    broken = plugins.add("broken", source, header=False, version="0.9")
    good = plugins.good("alpha")
    registry = load_plugins(entry_points=[broken, good])
    rec = _failed(registry, "broken")
    assert rec.error == expected
    assert rec.distribution == "portaserve-broken" and rec.version == "0.9"
    assert rec.label() == "broken (portaserve-broken 0.9)"
    assert registry.record("alpha").loaded


def test_missing_module(plugins):
    spec = EntryPointSpec("ghost", "portaserve_ghost_plugin", PLATFORM_GROUP, "portaserve-ghost", "1.0")
    registry = load_plugins(entry_points=[spec])
    assert "No module named 'portaserve_ghost_plugin'" in _failed(registry, "ghost").error


@pytest.mark.parametrize(
    ("declared", "expected"),
    [
        (None, "does not declare PORTASERVE_CONTRACT (portaserve's contract is 1.6)"),
        ("2.0", "built for contract 2.0, but this portaserve provides contract 1.6"),
        ("0.9", "built for contract 0.9, but this portaserve provides contract 1.6"),
        ("1.7", "built for contract 1.7, but this portaserve provides contract 1.6"),
        ("one", "PORTASERVE_CONTRACT 'one' is not 'major.minor' (portaserve's contract is 1.6)"),
        ("1.0.0", "PORTASERVE_CONTRACT '1.0.0' is not 'major.minor' (portaserve's contract is 1.6)"),
    ],
)
def test_contract_version_checked_with_both_versions_in_the_message(plugins, declared, expected):
    source = GOOD_PLATFORM.format(platform="old").replace('PORTASERVE_CONTRACT = "1.0"', "")
    if declared is not None:
        source = f"PORTASERVE_CONTRACT = {declared!r}\n" + source
    spec = plugins.add("old", source)
    registry = load_plugins(entry_points=[spec])
    rec = _failed(registry, "old")
    assert rec.error == expected
    _assert_no_contribution(registry, "old")


def test_a_raising_hook_drops_the_whole_plugin(plugins):
    source = GOOD_PLATFORM.format(platform="half") + """

@hookimpl
def portaserve_kv_cache_allocators():
    raise ValueError("allocator table is corrupt")
"""
    registry = load_plugins(entry_points=[plugins.add("half", source), plugins.good("alpha")])
    rec = _failed(registry, "half")
    assert rec.error.startswith("hook portaserve_kv_cache_allocators raised ValueError: allocator table is corrupt (")
    assert ".py:" in rec.error  # where it raised
    _assert_no_contribution(registry, "half")  # its platform and communicator are dropped too
    assert registry.record("alpha").loaded


@pytest.mark.parametrize(
    ("hooks", "expected"),
    [
        ("@hookimpl\ndef portaserve_platform():\n    return 'not a class'\n",
         "portaserve_platform returned 'not a class', not a Platform subclass"),
        ("@hookimpl\ndef portaserve_platform():\n    return dict\n",
         "portaserve_platform returned <class 'dict'>, not a Platform subclass"),
        ("class Half(Platform):\n    name = 'half'\n    device_type = 'cpu'\n    dist_backend = 'gloo'\n"
         "@hookimpl\ndef portaserve_platform():\n    return Half\n",
         "portaserve_platform returned Half, which does not implement _memory_info, _torch_device, capabilities, probe"),
        ("@hookimpl\ndef portaserve_communicators():\n    return [('x', TorchDistributedCommunicator)]\n",
         "portaserve_communicators must return a mapping of name to class, got list"),
        ("@hookimpl\ndef portaserve_communicators():\n    return {'c': dict}\n",
         "portaserve_communicators: communicators 'c' is <class 'dict'>, not a Communicator subclass"),
        ("class C(TorchDistributedCommunicator):\n    name = 'other'\n    platforms = frozenset({'cpu'})\n"
         "    dist_backend = 'gloo'\n@hookimpl\ndef portaserve_communicators():\n    return {'c': C}\n",
         "portaserve_communicators: communicators registered as 'c' but its class declares name 'other'"),
        ("@hookimpl\ndef portaserve_custom_ops():\n    return 5\n",
         "portaserve_custom_ops must return a sequence of OpImpl, got int"),
        ("@hookimpl\ndef portaserve_custom_ops():\n    return ['rms_norm']\n",
         "portaserve_custom_ops returned 'rms_norm', not an OpImpl"),
    ],
)
def test_wrong_return_types_are_reported(plugins, hooks, expected):
    spec = plugins.add("wrong", 'PORTASERVE_CONTRACT = "1.0"\n' + hooks)
    registry = load_plugins(entry_points=[spec])
    assert _failed(registry, "wrong").error == expected


def test_platform_without_a_name(plugins):
    source = GOOD_PLATFORM.format(platform="x").replace('    name = "x"\n', "")
    registry = load_plugins(entry_points=[plugins.add("nameless", source)])
    assert "P whose name is None" in _failed(registry, "nameless").error


def test_unknown_hook_name_is_reported(plugins):
    source = 'PORTASERVE_CONTRACT = "1.0"\n@hookimpl\ndef portaserve_platfrom():\n    return None\n'
    registry = load_plugins(entry_points=[plugins.add("typo", source)])
    error = _failed(registry, "typo").error
    assert error.startswith("implements unknown hook 'portaserve_platfrom'; known hooks: ")
    assert "portaserve_platform" in error and "portaserve_communicators" in error


def test_hook_with_a_wrong_signature_is_reported(plugins):
    source = 'PORTASERVE_CONTRACT = "1.0"\n@hookimpl\ndef portaserve_platform(config):\n    return None\n'
    registry = load_plugins(entry_points=[plugins.add("sig", source)])
    error = _failed(registry, "sig").error
    assert error.startswith("hook registration failed: PluginValidationError")
    assert "config" in error


def test_platform_name_clash_reported_against_the_second(plugins):
    registry = load_plugins(entry_points=[CPU_BUILTIN, plugins.good("impostor", platform="cpu")])
    rec = _failed(registry, "impostor")
    assert rec.error == "platform name 'cpu' is already registered by plugin 'cpu'"
    assert registry.record("cpu").loaded
    assert registry.platforms["cpu"].__module__ == "portaserve.platforms.cpu.platform"


def test_component_name_clash(plugins):
    source = """
PORTASERVE_CONTRACT = "1.0"


class Gloo2(TorchDistributedCommunicator):
    name = "gloo"
    platforms = frozenset({"cpu"})
    dist_backend = "gloo"


@hookimpl
def portaserve_communicators():
    return {"gloo": Gloo2}
"""
    registry = load_plugins(entry_points=[CPU_BUILTIN, plugins.add("dupe", source, group=PLUGIN_GROUP)])
    assert _failed(registry, "dupe").error == "communicator 'gloo' is already registered by plugin 'cpu'"
    assert registry.get("communicators", "gloo").__module__ == "portaserve.platforms.cpu.communicator"


def test_same_component_from_a_loaded_class_and_its_path_is_no_clash(plugins):
    source = """
PORTASERVE_CONTRACT = "1.0"


@hookimpl
def portaserve_communicators():
    from portaserve.platforms.cpu.communicator import GlooCommunicator
    return {"gloo": GlooCommunicator}
"""
    registry = load_plugins(entry_points=[CPU_BUILTIN])
    registry.get("communicators", "gloo")  # the "module:Class" string is now the class
    from portaserve.framework.plugins import _load_one  # the same registry, a second plugin
    import pluggy
    from portaserve.framework import hookspecs

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    _load_one(pm, registry, plugins.add("reexport", source, group=PLUGIN_GROUP))
    assert registry.record("reexport").loaded, registry.record("reexport").error


def test_lazy_component_that_fails_to_import_is_reported_on_use(plugins):
    source = """
PORTASERVE_CONTRACT = "1.0"


@hookimpl
def portaserve_kv_cache_allocators():
    return {"lazy": "portaserve_missing_module:Allocator"}
"""
    registry = load_plugins(entry_points=[plugins.add("lazy", source, group=PLUGIN_GROUP)])
    assert registry.record("lazy").loaded  # strings are imported when first needed
    assert registry.load_all("kv_cache_allocators") == {}
    rec = registry.record("lazy")
    assert rec.error == "kv_cache_allocators 'lazy' failed to import: ModuleNotFoundError: No module named 'portaserve_missing_module'"
    assert "lazy" not in registry.names("kv_cache_allocators")


def test_entry_point_naming_an_object_inside_a_module(plugins):
    source = GOOD_PLATFORM.format(platform="nested") + "\n\nclass plugin:\n    PORTASERVE_CONTRACT = '1.0'\n    portaserve_platform = staticmethod(portaserve_platform)\n"
    spec = plugins.add("nested", source, attr="plugin")
    registry = load_plugins(entry_points=[spec])
    rec = registry.record("nested")
    assert rec.loaded, rec.error
    assert rec.platform == "nested" and "communicators" not in rec.contributes


# ----- allow-list, autoload, strict -------------------------------------------------------------


def _specs(plugins):
    return [CPU_BUILTIN, plugins.good("alpha"), plugins.good("beta"),
            plugins.add("broken", "raise RuntimeError('no driver')", header=False)]


def test_allow_list_from_the_environment(plugins, monkeypatch):
    specs = _specs(plugins)
    monkeypatch.setenv("PORTASERVE_PLUGINS", "alpha, broken")
    registry = load_plugins(entry_points=specs)
    assert registry.record("cpu").loaded  # built-ins always load
    assert registry.record("alpha").loaded
    beta = registry.record("beta")
    assert not beta.loaded and beta.error is None
    assert beta.skipped == "not loaded: not in the allow-list PORTASERVE_PLUGINS=alpha,broken"
    assert "beta" not in registry.platforms
    assert registry.record("broken").error == "import failed: RuntimeError: no driver"
    assert [r.name for r in registry.failures()] == ["broken"]


def test_allow_list_argument_overrides_the_environment(plugins, monkeypatch):
    monkeypatch.setenv("PORTASERVE_PLUGINS", "alpha")
    registry = load_plugins(entry_points=_specs(plugins), allow=["beta"])
    assert registry.record("beta").loaded and registry.record("alpha").skipped
    assert registry.record("broken").skipped and not registry.failures()


def test_disable_autoload_loads_only_builtins(plugins, monkeypatch):
    monkeypatch.setenv("PORTASERVE_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = load_plugins(entry_points=_specs(plugins))
    assert set(registry.platforms) == {"cpu"}
    for name in ("alpha", "beta", "broken"):
        rec = registry.record(name)
        assert not rec.loaded and rec.error is None
        assert "PORTASERVE_DISABLE_PLUGIN_AUTOLOAD=1" in rec.skipped
    assert not registry.failures()
    assert load_plugins(entry_points=_specs(plugins), autoload=True).record("alpha").loaded


@pytest.mark.parametrize("how", ["env", "argument"])
def test_strict_mode_makes_a_broken_plugin_fatal(plugins, monkeypatch, how):
    specs = _specs(plugins)
    if how == "env":
        monkeypatch.setenv("PORTASERVE_STRICT_PLUGINS", "1")
        call = lambda: load_plugins(entry_points=specs)  # noqa: E731
    else:
        call = lambda: load_plugins(entry_points=specs, strict=True)  # noqa: E731
    with pytest.raises(PluginError) as err:
        call()
    msg = str(err.value)
    assert "1 plugin(s) failed (strict mode)" in msg
    assert "broken (portaserve-broken 1.2.3): import failed: RuntimeError: no driver" in msg


def test_strict_false_overrides_the_environment(plugins, monkeypatch):
    monkeypatch.setenv("PORTASERVE_STRICT_PLUGINS", "1")
    registry = load_plugins(entry_points=_specs(plugins), strict=False)
    assert [r.name for r in registry.failures()] == ["broken"]


def test_strict_mode_passes_when_nothing_is_broken(plugins):
    registry = load_plugins(entry_points=[CPU_BUILTIN, plugins.good("alpha")], strict=True)
    assert registry.record("alpha").loaded


def test_process_registry_checks_strictness_on_every_call(monkeypatch):
    # The installed plugins (the in-tree ones, and the example ones when pip-installed).
    reset_registry()
    registry = get_registry()
    assert registry.record("cpu").loaded and get_registry() is registry
    if registry.failures():
        with pytest.raises(PluginError):
            get_registry(strict=True)
    else:
        assert get_registry(strict=True) is registry
