"""The conformance kit, run exactly as a plugin author runs it: a separate pytest process,
started outside the repository, ``pytest --pyargs portaserve.framework.testing --platform NAME``.
The CPU platform, the pip-installed example plugin and a plugin built here with a
vLLM-style KV layout (tests/framework/testing/vllm_layout_plugin.py, installed as a distribution
into a temporary folder) must pass it; an unavailable platform fails it unless
``--allow-unavailable``; the end of every run is a one-page summary."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest


def run_kit(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PORTASERVE_")}
    full_env.update({"OMP_NUM_THREADS": "1", **(env or {})})
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "portaserve.framework.testing", "-q", "-rs",
           "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=full_env, timeout=900)


def _summary(proc) -> dict[str, int]:
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", tail)}


def install_layout_plugin(tmp_path, **env: str) -> dict[str, str]:
    """Install tests/framework/testing/vllm_layout_plugin.py as a distribution (a dist-info folder with its
    entry point) in a folder of its own; returns the environment that puts it on the path."""
    site = tmp_path / "site"
    info = site / "vllm_layout_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-layout-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[portaserve.platforms]\nvlayout = vllm_layout_plugin\n")
    shutil.copy(Path(__file__).with_name("vllm_layout_plugin.py"), site)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **env}


def _example_installed(distribution: str = "portaserve-example-platform") -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return os.environ.get("PORTASERVE_REQUIRE_EXAMPLES") == "1"  # then fail, not skip
    return True


def _assert_passed(proc, platform: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    counts = _summary(proc)
    assert counts.get("passed", 0) >= 20 and not counts.get("failed") and not counts.get("error"), out[-3000:]
    _assert_summary(proc, platform)
    # On an available platform the device checks must not skip: world size 2, budgets and
    # collectives really ran (attention cases may skip what a backend does not declare).
    skips = re.findall(r"SKIPPED \[\d+\] (\S+):", proc.stdout)
    device_checks = ("test_communicator.py", "test_kv_cache.py", "test_capabilities.py")
    assert not [s for s in skips if any(c in s for c in device_checks)], out[-3000:]


def _assert_summary(proc, platform: str) -> None:
    """The one-page summary: platform, plugin, declarations, contributions, results per module."""
    out = proc.stdout
    assert f"portaserve conformance kit: platform {platform}" in out, out[-3000:]
    summary = out[out.index(f"portaserve conformance kit: platform {platform}"):]
    for heading in ("plugin: ", "device: ", "declares: block sizes", "contributes:", "attention backends: ",
                    "KV-cache allocators: ", "communicators: ", "ops: ", "quant methods: ", "platform models: ",
                    "results:"):
        assert heading in summary, f"{heading!r} missing from the summary:\n{summary[:3000]}"
    for module in ("test_attention_backends.py", "test_kv_cache.py", "test_communicator.py", "test_ops.py",
                   "test_quant_methods.py", "test_probe.py", "test_capabilities.py", "test_graph_capture.py",
                   "test_vision_models.py"):
        assert re.search(rf"{module}\s+\d+ (passed|failed|skipped|error)", summary), f"{module} missing:\n{summary[:3000]}"
    assert re.search(r"total\s+\d+ passed", summary)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_passes_the_kit_which_defaults_to_the_auto_platform(tmp_path):
    # No --platform: the kit tests what --device auto selects, the CPU on this machine.
    _assert_passed(run_kit(tmp_path), "cpu")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not _example_installed(), reason="pip install ./examples/portaserve-example-platform first")
def test_example_plugin_passes_the_kit(tmp_path):
    _assert_passed(run_kit(tmp_path, "--platform", "example"), "example")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plugin_with_a_vllm_kv_layout_passes_the_kit(tmp_path):
    # Issue 22, failure 2: the [2, num_blocks, ...] layout used to fail inside the kit.
    proc = run_kit(tmp_path, "--platform", "vlayout", env=install_layout_plugin(tmp_path))
    _assert_passed(proc, "vlayout")
    assert "IndexError" not in proc.stdout
    assert "vlayout_torch (preferred #1, KV block dim 1)" in proc.stdout
    assert "block sizes [16, 32] (default 32)" in proc.stdout
    # Issue 22, failure 3: the plugin's own op, its op implementations and its quant method ran.
    assert "ops: vlayout_gelu_and_mul:vlayout_torch, rms_norm:vlayout_torch" in proc.stdout
    assert "op specs declared: vlayout_gelu_and_mul" in proc.stdout
    assert "quant methods: vlayout_linear (variant of none)" in proc.stdout
    assert re.search(r"test_ops.py\s+9 passed\n", proc.stdout), proc.stdout[-3000:]


@pytest.mark.slow
def test_kit_on_an_unavailable_platform_fails_with_the_reason(tmp_path):
    # Issue 22, failure 6: a kit run on the wrong machine must not be green.
    proc = run_kit(tmp_path, "--platform", "tpu", "-k", "kv_cache or communicator or attention")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "device 'tpu' is not available: torch_xla is not installed" in proc.stdout
    assert "--allow-unavailable" in proc.stdout
    assert not _summary(proc).get("passed") and not _summary(proc).get("skipped"), out[-3000:]
    assert "device: UNAVAILABLE" in proc.stdout and "device checks FAILED" in proc.stdout


@pytest.mark.slow
def test_kit_on_an_unavailable_platform_skips_with_allow_unavailable(tmp_path):
    proc = run_kit(tmp_path, "--platform", "tpu", "--allow-unavailable", "-k", "kv_cache or communicator")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "device 'tpu' is not available: torch_xla is not installed" in proc.stdout
    counts = _summary(proc)
    assert counts.get("skipped", 0) >= 5 and not counts.get("failed") and not counts.get("error")
    assert "device checks SKIPPED (--allow-unavailable)" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_world_size_2_on_one_unshared_device_fails_unless_allowed(tmp_path):
    # Issue 22, failure 6: the 2-process check used to skip quietly with fewer than 2 devices.
    env = install_layout_plugin(tmp_path, VLAYOUT_ONE_DEVICE_PER_RANK="1")
    proc = run_kit(tmp_path, "--platform", "vlayout", "-k", "world_size_2", env=env)
    assert proc.returncode != 0, (proc.stdout + proc.stderr)[-3000:]
    assert "world size 2 needs 2 vlayout devices" in proc.stdout and "--allow-single-device" in proc.stdout
    proc = run_kit(tmp_path, "--platform", "vlayout", "-k", "world_size_2", "--allow-single-device", env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert _summary(proc) == {"skipped": 1}


@pytest.mark.slow
def test_kit_rejects_an_unknown_platform(tmp_path):
    proc = run_kit(tmp_path, "--platform", "no_such_platform", "-k", "probe")
    assert proc.returncode != 0
    assert "platform 'no_such_platform' is not registered" in proc.stdout


BAD_MODEL_PLUGIN = '''
"""A platform whose own Llama scales its logits by 1.05: close, wrong."""
import torch
from portaserve.framework.hookspecs import hookimpl
from portaserve.framework.interfaces import DeviceInfo, Platform, PlatformCapabilities
from portaserve.framework.distributed import TorchDistributedCommunicator
from portaserve.models.llama import LlamaForCausalLM
from portaserve.platforms.cpu.attention import CpuPagedAttentionBackend
from portaserve.platforms.cpu.kv_cache import HostKVCacheAllocator

PORTASERVE_CONTRACT = "1.1"


class Attn(CpuPagedAttentionBackend):
    name = "badmodel_paged"
    platforms = frozenset({"badmodel"})


class Kv(HostKVCacheAllocator):
    name = "badmodel_kv"
    platforms = frozenset({"badmodel"})


class Comm(TorchDistributedCommunicator):
    name = "badmodel_gloo"
    platforms = frozenset({"badmodel"})
    dist_backend = "gloo"


class BadModelPlatform(Platform):
    name = "badmodel"
    device_type = "cpu"
    dist_backend = "gloo"
    ranks_share_device = True

    @classmethod
    def probe(cls):
        return DeviceInfo(cls.name, "host", 1, 2**33, -30, "always")

    def capabilities(self):
        return PlatformCapabilities(dtypes=frozenset({torch.float32}), kv_cache_dtypes=frozenset({"auto"}))

    def preferred_attention_backends(self):
        return ("badmodel_paged",)

    def default_communicator(self):
        return "badmodel_gloo"

    def default_kv_cache_allocator(self):
        return "badmodel_kv"

    def _torch_device(self, local_rank):
        return torch.device("cpu")

    def _memory_info(self, local_rank):
        return (2**33, 2**33)


class OffByFivePercent(LlamaForCausalLM):
    def compute_logits(self, hidden):
        return super().compute_logits(hidden) * 1.05


@hookimpl
def portaserve_platform():
    return BadModelPlatform


@hookimpl
def portaserve_platform_model_architectures():
    return {"badmodel": {"LlamaForCausalLM": OffByFivePercent}}


@hookimpl
def portaserve_attention_backends():
    return {Attn.name: Attn}


@hookimpl
def portaserve_kv_cache_allocators():
    return {Kv.name: Kv}


@hookimpl
def portaserve_communicators():
    return {Comm.name: Comm}
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_kit_catches_a_platform_model_that_drifts_from_the_generic_one(tmp_path):
    site = tmp_path / "site"
    info = site / "bad_model_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-model-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[portaserve.platforms]\nbadmodel = bad_model_plugin\n")
    (site / "bad_model_plugin.py").write_text(BAD_MODEL_PLUGIN)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "portaserve.framework.testing.test_platform_models", "-q",
         "-p", "no:cacheprovider", "--platform", "badmodel"],
        cwd=tmp_path, capture_output=True, text=True, timeout=280,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("PORTASERVE_")}, **env},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "badmodel's LlamaForCausalLM: prompt 0" in out and "logprobs differ from the generic model's" in out, out[-4000:]
