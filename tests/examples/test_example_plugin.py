"""The pip-installed example plugins (examples/): portaserve-example-platform is listed,
selectable with --device example and usable; portaserve-broken-plugin is reported and
skipped, and fatal under strict mode. Nothing in framework/ knows about either.

Install them first: ``pip install ./examples/portaserve-example-platform
./examples/portaserve-broken-plugin`` (.ci/run does, and sets PORTASERVE_REQUIRE_EXAMPLES=1
so that a missing install fails instead of skipping)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from portaserve.framework.config import EngineConfig
from portaserve.framework.errors import PlatformUnavailableError, PluginError
from portaserve.framework.plan import attention_candidates, resolve_platform_choices
from portaserve.framework.plugins import load_plugins
from portaserve.framework.selection import choose_platform

EXAMPLE_DIST = "portaserve-example-platform"
BROKEN_DIST = "portaserve-broken-plugin"


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


_missing = [d for d in (EXAMPLE_DIST, BROKEN_DIST) if not _installed(d)]
if _missing and os.environ.get("PORTASERVE_REQUIRE_EXAMPLES") == "1":
    raise RuntimeError(f"PORTASERVE_REQUIRE_EXAMPLES=1 but not installed: {', '.join(_missing)}")
pytestmark = [
    pytest.mark.usefixtures("plugin_env"),
    pytest.mark.skipif(bool(_missing), reason=f"pip install ./examples/<name> first; missing: {', '.join(_missing)}"),
]


def portaserve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the installed `portaserve` console script (falls back to its entry function)."""
    script = Path(sys.executable).with_name("portaserve")
    cmd = [str(script)] if script.exists() else [sys.executable, "-c", "import sys; from portaserve.framework.cli import main; sys.exit(main())"]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PORTASERVE_")}
    full_env.update(env or {})
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=full_env, timeout=300)


def _by_name(items):
    return {i["name"]: i for i in items}


@pytest.fixture(scope="module")
def platforms_json():
    proc = portaserve("platforms", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_listed_by_portaserve_platforms(platforms_json):
    plugins = _by_name(platforms_json["plugins"])
    example = plugins["example"]
    assert example["status"] == "loaded" and example["error"] is None
    assert example["distribution"] == EXAMPLE_DIST and example["version"] == metadata.version(EXAMPLE_DIST)
    assert example["builtin"] is False and example["contract"] == "1.1" and example["platform"] == "example"
    assert example["contributes"] == {
        "attention_backends": ["example_paged"],
        "communicators": ["example_gloo"],
        "kv_cache_allocators": ["example"],
    }
    platforms = _by_name(platforms_json["platforms"])
    assert platforms["example"]["available"] and platforms["example"]["device"]["score"] == -10
    assert platforms["example"]["default_communicator"] == "example_gloo"


def test_this_machine_selects_cpu_and_lists_the_vendors_unavailable(platforms_json):
    if torch.cuda.is_available() or torch.xpu.is_available():
        pytest.skip("this check describes a machine without accelerators")
    sel = platforms_json["selection"]
    assert sel["device"] == "auto" and sel["selected"] == "cpu" and sel["error"] is None
    assert sel["plan"]["communicator"]["name"] == "gloo"
    platforms = _by_name(platforms_json["platforms"])
    assert platforms["cpu"]["available"]
    for vendor in ("cuda", "rocm", "xpu", "tpu"):
        assert platforms[vendor]["available"] is False and platforms[vendor]["error"] is None
        assert len(platforms[vendor]["reason"]) > 20
    assert dict(sel["rejected"])["example"] == "lower score -10 < 0"


def test_broken_plugin_reported_and_skipped_in_the_listing(platforms_json):
    plugins = _by_name(platforms_json["plugins"])
    imp = plugins["broken_import"]
    assert imp["status"] == "failed" and imp["loaded"] is False
    assert imp["distribution"] == BROKEN_DIST and imp["version"] == metadata.version(BROKEN_DIST)
    assert imp["error"].startswith("import failed: ImportError: libbrokenvendor.so.1")
    probe = plugins["broken_probe"]
    assert probe["status"] == "error" and probe["error"].startswith("probe raised RuntimeError: broken driver query")
    broken = _by_name(platforms_json["platforms"])["broken"]
    assert broken["available"] is False and broken["error"] == probe["error"]


@pytest.mark.slow
def test_selectable_with_device_example_on_the_command_line():
    proc = portaserve("platforms", "--json", "--device", "example")
    assert proc.returncode == 0, proc.stderr
    sel = json.loads(proc.stdout)["selection"]
    assert sel["selected"] == "example" and sel["reason"] == "forced with --device example"
    assert sel["plan"]["kv_cache_allocator"]["name"] == "example"
    assert sel["plan"]["communicator"]["name"] == "example_gloo"
    assert sel["plan"]["attention_candidates"][0]["name"] == "example_paged"
    from portaserve.framework.cli.platforms import collect, render

    text = render(collect(load_plugins(strict=False), "example"))
    assert "--device example selects example: forced with --device example" in text
    assert "communicator        example_gloo  (platform example's default)" in text


@pytest.mark.slow
def test_portaserve_device_variable_selects_it():
    proc = portaserve("platforms", "--json", env={"PORTASERVE_DEVICE": "example"})
    assert json.loads(proc.stdout)["selection"]["selected"] == "example"


def test_selected_platform_and_its_components_work():
    registry = load_plugins(strict=False)
    choice = choose_platform(registry, "example", strict=False)
    platform = choice.instantiate()
    assert type(platform).__module__ == "portaserve_example_platform.platform"
    assert platform.torch_device(0) == torch.device("cpu")
    choices = dict(resolve_platform_choices(EngineConfig(), registry, platform))
    assert choices["communicator"].name == "example_gloo"
    assert choices["kv_cache_allocator"].name == "example"
    assert [c.name for c in attention_candidates(registry, platform)][0] == "example_paged"

    comm_cls = registry.get("communicators", "example_gloo")
    comm = comm_cls(0, 1, platform.torch_device(0))
    x = torch.arange(6.0)
    assert torch.equal(comm.all_reduce(x.clone()), x)

    alloc = registry.get("kv_cache_allocators", "example")(platform.torch_device(0))
    budget = platform.kv_cache_budget_bytes(0.001)
    bytes_per_block = 2 * 2 * 16 * 8 * 4  # K and V, 2 heads, block 16, head 8, fp32
    num_blocks = alloc.num_blocks(budget, bytes_per_block)
    assert num_blocks == int(0.001 * 2**30) // bytes_per_block
    (cache,) = alloc.allocate([(num_blocks, 2, 2, 16, 8)], [torch.float32])
    assert cache.shape == (num_blocks, 2, 2, 16, 8) and not cache.any()

    backend_cls = registry.get("attention_backends", "example_paged")
    assert backend_cls.platforms == frozenset({"example"})


def test_components_build_on_the_interfaces_only():
    """The example's classes derive from portaserve's interfaces, never from another
    platform's implementation (the CPU's backend, the framework's gloo communicator):
    a vendor cannot rely on those staying as they are."""
    registry = load_plugins(strict=False)
    classes = [registry.platforms["example"]] + [
        registry.get(kind, name)
        for kind, name in (("attention_backends", "example_paged"), ("communicators", "example_gloo"),
                           ("kv_cache_allocators", "example"))
    ]
    for cls in classes:
        foreign = [
            base.__module__ for base in cls.__mro__[1:]
            if base.__module__.startswith("portaserve") and not base.__module__.startswith("portaserve.framework.interfaces")
        ]
        assert not foreign, f"{cls.__name__} derives from {foreign}"
    assert registry.platforms["example"].ranks_share_device


def test_broken_plugins_are_skipped_in_process():
    registry = load_plugins(strict=False)
    failed = {r.name: r for r in registry.failures()}
    assert "broken_import" in failed and not failed["broken_import"].loaded
    assert "broken_probe" not in failed and registry.record("broken_probe").loaded  # not probed yet
    assert choose_platform(registry, "auto", strict=False).platform_cls.name == "cpu"
    assert "probe raised RuntimeError" in registry.record("broken_probe").error
    with pytest.raises(PlatformUnavailableError, match="broken driver query"):
        choose_platform(registry, "broken", strict=False)


def test_allow_list_leaves_the_broken_plugin_out(monkeypatch):
    monkeypatch.setenv("PORTASERVE_PLUGINS", "example")
    registry = load_plugins(strict=True)  # nothing broken is loaded, so strict passes
    assert registry.record("example").loaded
    assert registry.record("broken_import").skipped and registry.record("broken_import").error is None
    assert "broken" not in registry.platforms


@pytest.mark.slow
def test_strict_mode_makes_the_broken_plugin_fatal(monkeypatch):
    with pytest.raises(PluginError) as err:
        load_plugins(strict=True)
    assert f"broken_import ({BROKEN_DIST} " in str(err.value)
    assert "libbrokenvendor.so.1" in str(err.value)
    # The probe failure is fatal when the platform is chosen strictly.
    monkeypatch.setenv("PORTASERVE_PLUGINS", "broken_probe")
    registry = load_plugins(strict=True)  # it imports fine...
    with pytest.raises(PluginError, match="broken_probe.*broken driver query"):
        choose_platform(registry, "auto", strict=True)  # ...but its probe raises
    # And the command line says so with its exit status.
    proc = portaserve("platforms", env={"PORTASERVE_STRICT_PLUGINS": "1"})
    assert proc.returncode == 1 and "broken_import" in proc.stdout
    assert portaserve("platforms", "--strict-plugins", env={"PORTASERVE_PLUGINS": "example"}).returncode == 0
