"""benchmarks/structured_outputs.py runs and prints its table row (one backend and mode,
a tiny checkpoint, a small batch): the script BENCHMARKS.md cites keeps working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow  # an engine in a subprocess

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "structured_outputs.py"


def test_one_row(checkpoint):
    folder = checkpoint("Qwen2ForCausalLM")
    out = subprocess.run([sys.executable, str(SCRIPT), "--one", "xgrammar", "overlap", "--model", folder, "--n", "4",
                          "--max-tokens", "16"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    row = [line for line in out.stdout.splitlines() if line.startswith("| xgrammar | overlap |")]
    assert row and float(row[0].split("|")[-2]) > 0
