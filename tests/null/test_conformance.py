"""The conformance kit, run exactly as a plugin author runs it: a separate pytest process,
started outside the repository, ``pytest --pyargs portaserve.framework.testing --platform NAME``.
The CPU platform and the pip-installed example plugin must pass it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata

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


def _example_installed() -> bool:
    try:
        metadata.distribution("portaserve-example-platform")
    except metadata.PackageNotFoundError:
        return os.environ.get("PORTASERVE_REQUIRE_EXAMPLES") == "1"  # then fail, not skip
    return True


def _assert_passed(proc, platform: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    counts = _summary(proc)
    assert counts.get("passed", 0) >= 20 and not counts.get("failed") and not counts.get("error"), out[-3000:]
    assert f"portaserve conformance kit: platform {platform}" in proc.stdout
    # On an available platform the device checks must not skip: world size 2, budgets and
    # collectives really ran (attention cases may skip what a backend does not declare).
    skips = re.findall(r"SKIPPED \[\d+\] (\S+):", proc.stdout)
    device_checks = ("test_communicator.py", "test_kv_cache.py", "test_capabilities.py")
    assert not [s for s in skips if any(c in s for c in device_checks)], out[-3000:]


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
def test_kit_on_an_unavailable_platform_skips_with_the_reason(tmp_path):
    proc = run_kit(tmp_path, "--platform", "tpu", "-k", "kv_cache or communicator")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "device 'tpu' is not available: torch_xla is not installed" in proc.stdout


@pytest.mark.slow
def test_kit_rejects_an_unknown_platform(tmp_path):
    proc = run_kit(tmp_path, "--platform", "no_such_platform", "-k", "probe")
    assert proc.returncode != 0
    assert "platform 'no_such_platform' is not registered" in proc.stdout
