"""Quantization and compilation on the CPU: int8 vs bf16, eager vs compiled, cold vs warm start.

Every comparison runs side by side in one process with the candidates alternating
(the dev machine is shared: other engineers' jobs move absolute numbers, ratios much
less), and the load average is recorded with the numbers.

1. matmul: the int8 kernels this machine could use vs bf16 and fp32 `F.linear` on the
   Qwen2-0.5B linear shapes (qkv 896x1152, o 896x896, gate_up 896x9728, down 4864x896),
   M = 1..64 tokens: the measurement behind `int8_kernels`' choice.
2. decode: engines of the checkpoint built once each (bf16 eager, int8 eager, bf16
   compiled), every decode step of batch 1 and batch 64 timed; per run the fastest step
   (other jobs only add time), the median over alternating runs; tokens/s, and weight
   memory measured from the loaded parameters.
3. start: a fresh process per run, from interpreter start to the first generated token
   (batch 1 and batch 4, so both compiled graphs exist): eager, compiled with an empty
   inductor cache (cold) and again with the cache it left (warm).

    .venv/bin/python benchmarks/quant_compile.py                 # bench checkpoint, writes BENCHMARKS.md
    .venv/bin/python benchmarks/quant_compile.py --size small    # the demo-sized model (compile default)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable

def markers(size: str) -> tuple[str, str]:
    """Each checkpoint size keeps its own section of BENCHMARKS.md."""
    return f"<!-- quant_compile:{size}:start -->", f"<!-- quant_compile:{size}:end -->"

SHAPES = ((896, 1152), (896, 896), (896, 9728), (4864, 896))  # (in, out) of Qwen2-0.5B's linears


def checkpoint(size: str, folder: Path | None) -> Path:
    from portaserve.models.checkpoints import write_checkpoint

    folder = folder or Path.home() / ".cache/portaserve/bench" / f"Qwen2ForCausalLM-{size}"
    if not (folder / "config.json").exists():
        print(f"writing the {size} checkpoint to {folder} (once)", file=sys.stderr)
        write_checkpoint("Qwen2ForCausalLM", size, folder, 0)
    return folder


def load() -> tuple[float, float, float]:
    return tuple(round(x, 2) for x in os.getloadavg())


# ----- 1. matmul ---------------------------------------------------------------------------


def bench_matmul(ms: list[int], reps: int) -> dict:
    import torch
    import torch.nn.functional as F

    from portaserve.framework.quantization.int8 import quantize_int8_per_channel

    torch.manual_seed(0)
    layers = []
    for k, n in SHAPES:
        w = torch.randn(n, k) * 0.02
        q, s = quantize_int8_per_channel(w)
        layers.append((w, w.bfloat16(), q, s, s.bfloat16()))
    out = {}
    for m in ms:
        xs = [torch.randn(m, k) for k, _ in SHAPES]
        xb = [x.bfloat16() for x in xs]
        cands = {
            "bf16 F.linear": lambda: [F.linear(x, L[1]) for x, L in zip(xb, layers)],
            "fp32 F.linear": lambda: [F.linear(x, L[0]) for x, L in zip(xs, layers)],
            "int8pack, bf16 act": lambda: [torch.ops.aten._weight_int8pack_mm(x, L[2], L[4]) for x, L in zip(xb, layers)],
            "int8pack, fp32 act": lambda: [torch.ops.aten._weight_int8pack_mm(x, L[2], L[3]) for x, L in zip(xs, layers)],
            "int8 dequant + bf16 F.linear": lambda: [F.linear(x, L[2].to(torch.bfloat16)) * L[4] for x, L in zip(xb, layers)],
        }
        best = {name: float("inf") for name in cands}
        for fn in cands.values():
            fn()
        for _ in range(reps):
            for name, fn in cands.items():
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
        out[m] = {name: v * 1e3 for name, v in best.items()}
        print(f"matmul M={m}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in out[m].items()), file=sys.stderr)
    return out


# ----- 2. decode ---------------------------------------------------------------------------


def _runner(llm):
    return llm.llm_engine.core.executor.worker.runner


def weight_bytes(llm) -> int:
    model = _runner(llm).model
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def linear_weight_bytes(llm) -> int:
    """Bytes of the layers a QuantMethod owns (embeddings and the tied LM head excluded)."""
    model = _runner(llm).model
    total = 0
    for m in model.modules():
        if getattr(m, "quant_method", None) is not None:
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total


def decode_steps(llm, batch: int, prompt_len: int, steps: int, seed: int) -> list[float]:
    """Seconds of each decode step of `batch` sequences (prefill excluded)."""
    import random

    from portaserve import SamplingParams

    engine = llm.llm_engine
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{seed}-{i}", {"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(prompt_len)]}, params)
    times = []
    # prefill (possibly in chunks) until every sequence has its first token
    while True:
        engine.step()
        sched = engine.core.scheduler
        if not engine.has_unfinished_requests() or (not len(sched.waiting) and all(r.output_token_ids for r in sched.running)):
            break
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times[:-1] if len(times) > 1 else times  # the last step also finishes requests


def bench_decode(ckpt: Path, configs: dict[str, dict], batches: list[int], reps: int, steps: int, prompt_len: int, threads: int) -> dict:
    from portaserve import LLM

    engines, info = {}, {}
    for name, kwargs in configs.items():
        t = time.perf_counter()
        engines[name] = LLM(str(ckpt), max_model_len=prompt_len + steps + 16, max_num_seqs=max(batches),
                            enable_prefix_caching=False, **kwargs)
        # warm-up: compiles every graph a decode of each batch size needs
        for b in batches:
            decode_steps(engines[name], b, prompt_len, 2, seed=-b)
        info[name] = {"kwargs": kwargs, "build_and_warmup_s": time.perf_counter() - t,
                      "weight_bytes": weight_bytes(engines[name]), "linear_weight_bytes": linear_weight_bytes(engines[name])}
        print(f"{name}: ready in {info[name]['build_and_warmup_s']:.1f}s, weights {info[name]['weight_bytes'] / 2**20:.1f} MiB", file=sys.stderr)
    results = {}
    names = list(engines)
    for b in batches:
        per = {n: [] for n in names}
        for rep in range(reps):
            for n in names[rep % len(names):] + names[: rep % len(names)]:
                # the fastest step of the run: other jobs on the shared machine only ever add time
                per[n].append(min(decode_steps(engines[n], b, prompt_len, steps, seed=rep)))
        results[b] = {n: {"step_ms": statistics.median(v) * 1e3, "tokens_per_s": b / statistics.median(v)} for n, v in per.items()}
        print(f"decode batch {b}: " + ", ".join(f"{n} {r['step_ms']:.1f} ms/step" for n, r in results[b].items()), file=sys.stderr)
    return {"engines": info, "decode": results}


# ----- 3. start ----------------------------------------------------------------------------

_START_SCRIPT = """
import time, json, sys
t0 = time.perf_counter()
from portaserve import LLM, SamplingParams
kw = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], max_model_len=256, **kw)
t1 = time.perf_counter()
p = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
llm.generate([{"prompt_token_ids": [1000 + i for i in range(16)]}], p, use_tqdm=False)
llm.generate([{"prompt_token_ids": [2000 + i + j for i in range(16)]} for j in range(4)], p, use_tqdm=False)
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "first_tokens_s": t2 - t1, "total_s": t2 - t0}))
"""


def bench_start(ckpt: Path, configs: dict[str, dict], threads: int) -> dict:
    out = {}
    cache = tempfile.mkdtemp(prefix="portaserve-inductor-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(threads)}
    for label, kwargs in configs.items():
        r = subprocess.run([PY, "-c", _START_SCRIPT, str(ckpt), json.dumps(kwargs)], env=env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"start run {label} failed:\n{r.stderr[-3000:]}")
        out[label] = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"start {label}: {out[label]}", file=sys.stderr)
    out["inductor_cache_dir"] = cache
    return out


# ----- report -------------------------------------------------------------------------------


def section(res: dict, argv: list[str]) -> str:
    m = res["machine"]
    start, end = markers(m["size"])
    title = "## Quantization and compilation" + ("" if m["size"] == "bench" else f" (`{m['size']}` checkpoint)")
    lines = [start, title, ""]
    lines.append(
        f"Machine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}; load average {m['load_before']} before, "
        f"{m['load_after']} after (other engineers' jobs were running: read the ratios). "
        f"Checkpoint `{m['size']}` (Qwen2ForCausalLM, random weights, bfloat16)."
    )
    lines += ["", f"Produced by: `python benchmarks/quant_compile.py {' '.join(argv)}`", ""]
    if res.get("matmul"):
        lines += ["### Int8 weight-only matmul kernels (the 4 linear shapes of one Qwen2-0.5B layer, ms, best of reps)", ""]
        names = list(next(iter(res["matmul"].values())))
        lines += ["| M | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for mm, row in res["matmul"].items():
            lines.append(f"| {mm} | " + " | ".join(f"{row[n]:.2f}" for n in names) + " |")
        lines.append("")
    if res.get("decode"):
        d = res["decode"]
        names = list(d["engines"])
        base = names[0]
        lines += [f"### Decode ({res['args']['steps']} steps after a {res['args']['prompt_len']}-token prompt; ms per step: the fastest "
                  f"step of each run, median of {res['args']['reps']} alternating runs)", ""]
        lines += ["| engine | weights (MiB) | linear layers (MiB) | " + " | ".join(f"batch {b}: ms/step (tok/s) | vs {base}" for b in d["decode"]) + " |"]
        lines += ["|---|---|---|" + "---|---|" * len(d["decode"])]
        for n in names:
            e = d["engines"][n]
            cells = [f"{n}", f"{e['weight_bytes'] / 2**20:.1f}", f"{e['linear_weight_bytes'] / 2**20:.1f}"]
            for b, row in d["decode"].items():
                cells.append(f"{row[n]['step_ms']:.1f} ({row[n]['tokens_per_s']:.1f})")
                cells.append(f"{row[base]['step_ms'] / row[n]['step_ms']:.2f}x")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if res.get("start"):
        s = res["start"]
        lines += ["### Start: process start to the first tokens (fresh process each; s)", ""]
        lines += ["| run | load engine | first tokens (compiles) | total |", "|---|---|---|---|"]
        for label, r in s.items():
            if isinstance(r, dict):
                lines.append(f"| {label} | {r['load_s']:.1f} | {r['first_tokens_s']:.1f} | {r['total_s']:.1f} |")
        lines.append("")
    lines.append(end)
    return "\n".join(lines)


def write_section(path: Path, text: str, size: str) -> None:
    start, end = markers(size)
    old = path.read_text() if path.exists() else "# Benchmarks\n\nEvery number here comes with the command that produced it.\n"
    if start in old and end in old:
        new = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _m: text, old, flags=re.S)
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(new)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="bench", choices=("small", "bench"))
    p.add_argument("--checkpoint", type=Path, default=None, help="default: ~/.cache/portaserve/bench/Qwen2ForCausalLM-<size>")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default="bf16-eager,int8-eager,bf16-compiled")
    p.add_argument("--skip", default="", help="comma list of: matmul,decode,start")
    p.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md", help="'-' prints instead")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    all_configs = {
        "bf16-eager": {"dtype": "bfloat16", "compilation_mode": "none"},
        "int8-eager": {"dtype": "bfloat16", "quantization": "int8", "compilation_mode": "none"},
        "bf16-compiled": {"dtype": "bfloat16", "compilation_mode": "max"},
        "int8-compiled": {"dtype": "bfloat16", "quantization": "int8", "compilation_mode": "max"},
    }
    configs = {n: all_configs[n] for n in args.configs.split(",")}
    batches = [int(b) for b in args.batches.split(",")]
    ckpt = checkpoint(args.size, args.checkpoint)
    from portaserve.platforms.cpu.platform import _cpu_name

    res: dict = {"machine": {"cpu": _cpu_name(), "threads": args.threads, "torch": torch.__version__, "size": args.size,
                             "load_before": load()},
                 "args": {"steps": args.steps, "prompt_len": args.prompt_len, "reps": args.reps}}
    if "matmul" not in skip:
        res["matmul"] = bench_matmul([1, 4, 16, 64], reps=max(5, 3 * args.reps))
    if "decode" not in skip:
        res["decode"] = bench_decode(ckpt, configs, batches, args.reps, args.steps, args.prompt_len, args.threads)
    if "start" not in skip:
        compiled = {k: v for k, v in configs.items() if v.get("compilation_mode") == "max"}
        eager = {k: v for k, v in configs.items() if v.get("compilation_mode") == "none"}
        runs = {}
        if eager:
            runs["eager"] = next(iter(eager.values()))
        if compiled:
            kw = next(iter(compiled.values()))
            runs["compiled, cold cache"] = kw
            runs["compiled, warm cache"] = kw
        res["start"] = bench_start(ckpt, runs, args.threads)
    res["machine"]["load_after"] = load()
    argv = sys.argv[1:]
    if args.json_out:
        args.json_out.write_text(json.dumps(res, indent=1, default=str))
    text = section(res, argv)
    if str(args.out) == "-":
        print(text)
    else:
        write_section(args.out, text, args.size)
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
