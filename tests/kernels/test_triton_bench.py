"""`portaserve bench kernels` without a GPU: the CLI wiring, the cost model, the
interpreter smoke run, and the clear refusal when there is neither GPU nor interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from portaserve.framework.cli import build_parser
from portaserve.kernels._interpret import interpreter_env

with interpreter_env():  # triton and the kernels are decorated (interpreted or compiled) on import
    pytest.importorskip("triton")
    from portaserve.kernels import activation, paged_attention, reshape_and_cache, rms_norm, rotary  # noqa: F401
    from portaserve.kernels.bench import Shapes, attention_cost, num_sets


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    """TRITON_INTERPRET=1 while each test runs (triton reads it at launch too), and only then."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_cli_wiring():
    args = build_parser().parse_args(["bench", "kernels", "--iters", "3", "--dtype", "float16"])
    assert args.benchmark == "kernels" and args.iters == 3 and args.dtype == "float16" and callable(args.func)


def test_attention_cost_model():
    shapes = Shapes(num_heads=8, num_kv_heads=2, head_size=64)
    # one decode over 100 tokens of context (99 cached + itself), 2-byte elements
    nbytes, flops = attention_cost([(99, 1)], shapes, 2)
    assert nbytes == 100 * 2 * 2 * 64 * 2 + 2 * 8 * 64 * 2
    assert flops == 4 * 100 * 8 * 64
    # a fresh 4-token prefill: 1 + 2 + 3 + 4 causal pairs
    _nbytes, flops = attention_cost([(0, 4)], shapes, 2)
    assert flops == 4 * 10 * 8 * 64
    assert num_sets(1) == 16 and num_sets(2**40) == 2


def test_interpreter_smoke_run(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = build_parser().parse_args(["bench", "kernels", "--iters", "1", "--warmup", "0", "--json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["interpreter"] is True and report["timing"] == "wall clock"
    kernels = {r["kernel"] for r in report["results"]}
    assert kernels == {
        "reshape_and_cache", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding (neox)", "paged_attention",
    }
    assert all(r["median_us"] > 0 and r["bytes"] > 0 for r in report["results"])
    assert any("splits=2" in r["shape"] for r in report["results"]), "the split-K path was not run"
    assert "not performance" in capsys.readouterr().out


@pytest.mark.slow
def test_refuses_without_gpu_or_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from portaserve.framework.cli import main; sys.exit(main(sys.argv[1:]))",
         "bench", "kernels", "--device", "cpu"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "no GPU here" in proc.stderr and "TRITON_INTERPRET=1" in proc.stderr
