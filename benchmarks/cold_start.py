"""Start-up time: `portaserve serve` (default model unless one is given) to `/health` 200.

    python benchmarks/cold_start.py [--runs 3] [--json out.json] [-- SERVE ARGS...]

Each run starts `portaserve serve --port P [SERVE ARGS]` as users do (a fresh process
group), polls http://127.0.0.1:P/health every 50 ms, and records when the port first
answers (any status: the server listens at once and says 503 while the engine loads) and
when /health first answers 200. Then it kills the whole process group. The first run of
a session is the "first start" (whatever the page cache and the compiled-kernel cache
hold); later runs are warm starts. With --log, each run's server output is kept beside
the JSON (the engine's own timings are in it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(port: int) -> int | None:
    """/health's status, or None when nothing listens yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1.0) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def one_start(serve_args: list[str], timeout: float, log_path: str | None) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "portaserve.framework.cli", "serve", "--port", str(port),
           "--host", "127.0.0.1", *serve_args]
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    listening = ready = None
    try:
        while time.perf_counter() - t0 < timeout:
            status = health(port)
            now = time.perf_counter() - t0
            if status is not None and listening is None:
                listening = now
            if status == 200:
                ready = now
                break
            if status == 500 or proc.poll() is not None:
                raise RuntimeError(f"the server failed to start (health {status}, exit {proc.poll()}); see {log_path or '--log'}")
            time.sleep(0.05)
        else:
            raise RuntimeError(f"no /health 200 within {timeout} s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        if log_path:
            log.close()
    return {"listening_s": round(listening, 3), "ready_s": round(ready, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for /health 200 per run")
    parser.add_argument("--json", help="write the runs here")
    parser.add_argument("--log", help="keep each run's server output at LOG.N")
    parser.add_argument("serve_args", nargs="*", help="after --: arguments for `portaserve serve` (default: none)")
    args = parser.parse_args(argv)
    runs = []
    for i in range(args.runs):
        run = one_start(args.serve_args, args.timeout, f"{args.log}.{i}" if args.log else None)
        runs.append(run)
        print(f"run {i + 1}: listening {run['listening_s']:.2f} s, /health 200 {run['ready_s']:.2f} s", flush=True)
    warm = [r["ready_s"] for r in runs[1:]]
    if warm:
        print(f"first start {runs[0]['ready_s']:.2f} s; warm starts: median {statistics.median(warm):.2f} s, "
              f"best {min(warm):.2f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"serve_args": args.serve_args, "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
