"""The soak script's short version (benchmarks/soak.py; its long run's numbers are in
BENCHMARKS.md): a few hundred mixed requests against two `portaserve serve` processes,
with no request lost, no KV block left in use, and bounded memory growth."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SOAK = Path(__file__).resolve().parents[3] / "benchmarks" / "soak.py"


def test_short_soak_loses_nothing_and_frees_every_block(tmp_path):
    report = tmp_path / "soak.json"
    cmd = [sys.executable, str(SOAK), "--requests", "400", "--concurrency", "16", "--json", str(report),
           "--max-growth", "0.10"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    data = json.loads(report.read_text())
    assert data["sent"] == 400 and data["lost"] == 0 and data["warmup_lost"] == 0, (
        data["lost_details"], data["warmup_lost_details"])
    assert data["answered"] + data["errored"] == data["sent"] and data["errored"] > 0  # bad requests were sent
    for server in data["servers"].values():
        assert server["kv_cache_usage_after"] == 0.0
        assert server["growth_halfway_to_end_pct"] <= 10.0
