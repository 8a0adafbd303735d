"""The detection matrix: each vendor runtime simulated at the probe boundary (see
tests/conftest.py `fake_devices`), then `--device auto|NAME` resolved by the real
in-tree platforms and the real selection code."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap

import pytest
import torch

from portaserve.framework.errors import PlatformUnavailableError, PluginError, UnsupportedError
from portaserve.framework.interfaces import SCORE_ACCELERATOR, DeviceInfo, Unavailable
from portaserve.framework.plugins import PLATFORM_GROUP, EntryPointSpec, discover_entry_points, load_plugins
from portaserve.framework.selection import choose_platform, probe_all

pytestmark = pytest.mark.usefixtures("plugin_env")

VENDORS = ("cuda", "rocm", "xpu", "tpu")
GiB = 2**30

# What each simulated vendor (fake_devices.<vendor>() defaults) must be reported as.
EXPECTED = {
    "cuda": dict(device_name="NVIDIA L4", device_count=1, total_memory_bytes=24 * GiB, capability="8.9"),
    "rocm": dict(device_name="AMD Instinct MI300X", device_count=1, total_memory_bytes=192 * GiB, capability="gfx942"),
    "xpu": dict(device_name="Intel(R) Data Center GPU Max 1550", device_count=1, total_memory_bytes=64 * GiB),
    "tpu": dict(device_name="TPU v5e", device_count=4, total_memory_bytes=16 * GiB, capability="v5e"),
}
COMMUNICATORS = {"cuda": ("nccl", "nccl"), "rocm": ("rccl", "nccl"), "xpu": ("xccl", "xccl"), "tpu": ("xla", None)}


@pytest.fixture
def registry():
    """The built-in plugins only (installed third-party ones must not change the matrix)."""
    return load_plugins(autoload=False, strict=False)


def _reports(choice_or_reports):
    reports = getattr(choice_or_reports, "reports", choice_or_reports)
    return {r.platform: r for r in reports}


def test_no_accelerator_selects_cpu_and_every_vendor_says_why(registry, fake_devices):
    before = dict(os.environ)
    choice = choose_platform(registry, "auto")
    assert choice.platform_cls.name == "cpu"
    assert dict(os.environ) == before
    reports = _reports(choice)
    rejected = dict(choice.rejected)
    for vendor in VENDORS:
        assert isinstance(reports[vendor].result, Unavailable)
        assert reports[vendor].error is None
        assert len(reports[vendor].result.reason) > 20
        assert rejected[vendor] == f"unavailable: {reports[vendor].result.reason}"
    assert "built without CUDA" in reports["cuda"].result.reason
    assert "built without ROCm" in reports["rocm"].result.reason
    assert "torch.xpu.is_available() is False" in reports["xpu"].result.reason
    assert "torch_xla is not installed" in reports["tpu"].result.reason


@pytest.mark.parametrize("vendor", VENDORS)
def test_each_vendor_alone_wins_auto(registry, fake_devices, vendor):
    getattr(fake_devices, vendor)()
    before = dict(os.environ)
    choice = choose_platform(registry, "auto")
    assert dict(os.environ) == before, "a probe changed os.environ"
    assert choice.platform_cls.name == vendor
    info = choice.device
    assert isinstance(info, DeviceInfo) and info.platform == vendor and info.score == SCORE_ACCELERATOR
    for key, value in EXPECTED[vendor].items():
        assert getattr(info, key) == value, key
    rejected = dict(choice.rejected)
    assert rejected["cpu"] == f"lower score 0 < {SCORE_ACCELERATOR}"
    for other in set(VENDORS) - {vendor}:
        assert rejected[other].startswith("unavailable: ")
    # The chosen platform's default components resolve for it in the registry.
    platform = choice.instantiate()
    comm_name, backend = COMMUNICATORS[vendor]
    assert platform.default_communicator() == comm_name
    comm = registry.get("communicators", comm_name)
    assert vendor in comm.platforms
    if backend is not None:
        assert comm.dist_backend == backend
    alloc = registry.get("kv_cache_allocators", platform.default_kv_cache_allocator())
    assert vendor in alloc.platforms


def test_tpu_probe_keeps_torch_xla_out_of_this_process(registry, fake_devices):
    fake_devices.tpu()
    before = dict(os.environ)
    reports = _reports(probe_all(registry))
    assert reports["tpu"].available
    assert "torch_xla" not in sys.modules  # PJRT was asked from a child process
    assert "PJRT_DEVICE" not in os.environ and dict(os.environ) == before


def test_probes_repeat_the_same_answer(registry, fake_devices):
    fake_devices.cuda(count=2)
    fake_devices.tpu()
    first = probe_all(registry)
    second = probe_all(registry)
    assert [r.result for r in first] == [r.result for r in second]


def test_no_probe_changes_the_environment_with_every_vendor_present(registry, fake_devices):
    for vendor in ("cuda", "xpu", "tpu"):
        getattr(fake_devices, vendor)()
    before = dict(os.environ)
    reports = _reports(probe_all(registry))
    assert dict(os.environ) == before
    assert {p for p, r in reports.items() if r.available} == {"cpu", "cuda", "xpu", "tpu"}


@pytest.mark.parametrize(("first", "second"), [("cuda", "xpu"), ("xpu", "tpu"), ("cuda", "tpu")])
def test_two_accelerators_with_the_same_score_is_an_error_naming_both(registry, fake_devices, first, second):
    getattr(fake_devices, first)()
    getattr(fake_devices, second)()
    with pytest.raises(UnsupportedError) as err:
        choose_platform(registry, "auto")
    msg = str(err.value)
    assert f"{first} (" in msg and f"{second} (" in msg
    assert "--device NAME" in msg and "PORTASERVE_DEVICE" in msg
    assert "cpu (" not in msg  # the CPU has a lower score: not a candidate of the tie


def test_forced_device_picks_it_among_several(registry, fake_devices):
    fake_devices.cuda()
    fake_devices.xpu()
    choice = choose_platform(registry, "xpu")
    assert choice.platform_cls.name == "xpu"
    assert "forced" in choice.reason
    assert dict(choice.rejected)["cuda"].startswith("not requested")
    assert choose_platform(registry, "cpu").platform_cls.name == "cpu"


@pytest.mark.parametrize(
    ("simulate", "device", "reason"),
    [
        (None, "cuda", "built without CUDA"),
        ("cuda_build_without_gpu", "cuda", "torch.cuda.is_available() is False"),
        ("cuda", "rocm", "is a CUDA build, not a ROCm (HIP) build"),
        ("rocm", "cuda", "is a ROCm (HIP"),
        (None, "xpu", "torch.xpu.is_available() is False"),
        (None, "tpu", "torch_xla is not installed"),
    ],
)
def test_forcing_an_unavailable_device_says_why(registry, fake_devices, simulate, device, reason):
    if simulate:
        getattr(fake_devices, simulate)()
    with pytest.raises(PlatformUnavailableError) as err:
        choose_platform(registry, device)
    assert f"device {device!r} is not available" in str(err.value)
    assert reason in str(err.value)


def test_tpu_unavailable_reasons(registry, fake_devices, monkeypatch):
    fake_devices.tpu(chips=0)
    with pytest.raises(PlatformUnavailableError, match="no TPU chip is attached"):
        choose_platform(registry, "tpu")


def test_tpu_pjrt_failure_is_the_reason(registry, fake_devices):
    fake_devices.tpu(pjrt_fails="TPU is already in use by process 4242")
    report = _reports(probe_all(registry))["tpu"]
    assert not report.available and report.error is None
    assert "PJRT could not open them" in report.result.reason
    assert "TPU is already in use by process 4242" in report.result.reason


def test_tpu_pjrt_device_pinned_elsewhere(registry, fake_devices, monkeypatch):
    fake_devices.tpu()
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    report = _reports(probe_all(registry))["tpu"]
    assert not report.available
    assert "PJRT_DEVICE=CPU" in report.result.reason


def test_unknown_device_lists_the_choices(registry, fake_devices):
    with pytest.raises(UnsupportedError) as err:
        choose_platform(registry, "quantum")
    msg = str(err.value)
    assert "'quantum'" in msg
    for name in ("auto", "cpu", *VENDORS):
        assert name in msg


def test_portaserve_device_variable(registry, fake_devices, monkeypatch):
    fake_devices.cuda()
    fake_devices.xpu()
    monkeypatch.setenv("PORTASERVE_DEVICE", "xpu")
    assert choose_platform(registry, None).platform_cls.name == "xpu"
    # "auto" is --device's default: it defers to the variable.
    assert choose_platform(registry, "auto").platform_cls.name == "xpu"
    # An explicit device name wins over the variable.
    assert choose_platform(registry, "cuda").platform_cls.name == "cuda"
    monkeypatch.setenv("PORTASERVE_DEVICE", "tpu")
    with pytest.raises(PlatformUnavailableError, match="torch_xla is not installed"):
        choose_platform(registry, None)


# ----- capabilities follow the simulated hardware --------------------------------------------


def _platform(registry, name):
    return choose_platform(registry, name).instantiate()


@pytest.mark.parametrize(
    ("capability", "bf16", "fp8", "int8"),
    [((7, 0), False, False, False), ((7, 5), False, False, True), ((8, 0), True, False, True),
     ((8, 9), True, True, True), ((9, 0), True, True, True)],
)
def test_cuda_capabilities_follow_compute_capability(registry, fake_devices, capability, bf16, fp8, int8):
    fake_devices.cuda(capability=capability)
    caps = _platform(registry, "cuda").capabilities()
    assert torch.float16 in caps.dtypes and torch.float32 in caps.dtypes
    assert (torch.bfloat16 in caps.dtypes) is bf16
    assert ("fp8" in caps.kv_cache_dtypes) is fp8 and ("fp8_matmul" in caps.features) is fp8
    assert ("int8_matmul" in caps.features) is int8
    assert ("triton" in caps.features) is (importlib.util.find_spec("triton") is not None)
    assert caps.compile_backends == {"default": "cudagraphs", "max": "inductor"}


@pytest.mark.parametrize(
    ("arch", "bf16", "fp8"),
    [("gfx942:sramecc+:xnack-", True, True), ("gfx950", True, True), ("gfx90a:sramecc+:xnack-", True, False),
     ("gfx1100", True, False), ("gfx906:sramecc-:xnack-", False, False)],
)
def test_rocm_capabilities_follow_gfx_arch(registry, fake_devices, arch, bf16, fp8):
    fake_devices.rocm(arch=arch)
    platform = _platform(registry, "rocm")
    assert platform.info.capability == arch.split(":")[0]
    caps = platform.capabilities()
    assert (torch.bfloat16 in caps.dtypes) is bf16
    assert ("fp8" in caps.kv_cache_dtypes) is fp8 and ("fp8_matmul" in caps.features) is fp8
    assert caps.compile_backends == {"default": "cudagraphs", "max": "inductor"}


def test_xpu_capabilities_follow_device_properties(registry, fake_devices):
    fake_devices.xpu(bf16=False, xmx=False)
    caps = _platform(registry, "xpu").capabilities()
    assert caps.dtypes == frozenset({torch.float32, torch.float16})
    assert "int8_matmul" not in caps.features and caps.kv_cache_dtypes == frozenset({"auto"})
    assert caps.compile_backends["default"] == "inductor"


def test_tpu_capabilities(registry, fake_devices):
    fake_devices.tpu(pci_device="0x005e", hbm_gib=32)
    platform = _platform(registry, "tpu")
    assert platform.info.device_name == "TPU v4" and platform.info.total_memory_bytes == 32 * GiB
    caps = platform.capabilities()
    assert caps.dtypes == frozenset({torch.float32, torch.bfloat16})
    assert caps.compile_backends == {"default": "openxla"}
    assert platform.preferred_attention_backends() == ("xla_paged",)


@pytest.mark.parametrize("vendor", ("cuda", "rocm", "xpu"))
def test_gpu_platforms_prefer_triton(registry, fake_devices, vendor):
    getattr(fake_devices, vendor)()
    assert _platform(registry, vendor).preferred_attention_backends()[0] == "triton"


def test_multi_gpu_count_and_rank_range(registry, fake_devices):
    fake_devices.cuda(count=4, capability=(9, 0), name="NVIDIA H100 80GB HBM3", memory_gib=80)
    platform = _platform(registry, "cuda")
    assert platform.device_count() == 4
    assert platform.torch_device(3) == torch.device("cuda", 3)
    with pytest.raises(ValueError, match="out of range"):
        platform.torch_device(4)


# ----- a plugin whose probe raises --------------------------------------------------------------

RAISING_PLUGIN = """
from portaserve.framework.hookspecs import hookimpl
from portaserve.framework.interfaces import Platform

PORTASERVE_CONTRACT = "1.0"


class RaisingPlatform(Platform):
    name = "raising"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def probe(cls):
        raise RuntimeError("driver exploded")

    def capabilities(self):
        raise NotImplementedError

    def _torch_device(self, local_rank):
        raise NotImplementedError

    def _memory_info(self, local_rank):
        raise NotImplementedError


@hookimpl
def portaserve_platform():
    return RaisingPlatform
"""


@pytest.fixture
def with_raising_plugin(tmp_path, monkeypatch):
    (tmp_path / "fake_raising_probe.py").write_text(textwrap.dedent(RAISING_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    builtins = [s for s in discover_entry_points() if s.builtin]
    spec = EntryPointSpec("raising", "fake_raising_probe", PLATFORM_GROUP, "fake-raising-dist", "0.3")
    return [*builtins, spec]


def test_a_raising_probe_is_reported_and_skipped(fake_devices, with_raising_plugin):
    registry = load_plugins(entry_points=with_raising_plugin, strict=False)
    choice = choose_platform(registry, "auto")
    assert choice.platform_cls.name == "cpu"
    report = _reports(choice)["raising"]
    assert report.error == "probe raised RuntimeError: driver exploded"
    assert "probe raised RuntimeError: driver exploded" in dict(choice.rejected)["raising"]
    rec = registry.record("raising")
    assert rec.distribution == "fake-raising-dist" and rec.version == "0.3"
    assert rec.error == "probe raised RuntimeError: driver exploded"  # once, though probed twice below
    choose_platform(registry, "auto")
    assert rec.error == "probe raised RuntimeError: driver exploded"
    with pytest.raises(PlatformUnavailableError, match="driver exploded"):
        choose_platform(registry, "raising")


def test_a_raising_probe_is_fatal_when_strict(fake_devices, with_raising_plugin, monkeypatch):
    registry = load_plugins(entry_points=with_raising_plugin, strict=False)
    with pytest.raises(PluginError, match="raising.*driver exploded"):
        choose_platform(registry, "auto", strict=True)
    monkeypatch.setenv("PORTASERVE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="driver exploded"):
        choose_platform(registry, "auto")
