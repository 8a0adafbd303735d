"""benchmarks/gguf_kernels.py runs and prints one row per type and row count with the
three paths' times (the table BENCHMARKS.md quotes)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from portaserve.platforms.cpu import native

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gguf_kernels.py"


@pytest.mark.skipif(native.load() is None or not native.load().gguf_gemm_available(),
                    reason="needs the C kernels with AVX512-BF16")
def test_the_kernel_benchmark_prints_its_table():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--types", "Q8_0", "--rows", "1,5", "--reps", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = re.findall(r"^\| Q8_0 \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["1", "5"], proc.stdout
    assert all(float(t) > 0 for r in rows for t in r[1:])
