"""Soak test: thousands of mixed requests against `portaserve serve`, watching for leaks.

    python benchmarks/soak.py [--requests 2000] [--concurrency 32] [--json out.json]

Starts two servers as users do (`portaserve serve` subprocesses): a small generative
vision-language checkpoint (LLaVA: a CLIP tower and a Qwen2 decoder) and a small
embedding checkpoint (random weights, written once into the portaserve cache folder). Then it sends a warm-up round of the whole mix, and the
measured requests at the given concurrency. The mix:

- chat and completions, streaming and not, n > 1, logprobs, tools, stop strings;
- clients that disconnect mid-stream, requests aborted by a client timeout;
- bad requests (each must be a 400 in OpenAI's error shape);
- images: data: URLs of random sizes (some repeated, so the encoder cache serves them),
  one or two per message, and broken images (a 400 naming the content part);
- embeddings.

It records the resident memory of each server's whole process tree after the warm-up,
halfway and at the end. The report gives the growth from halfway to the end, the KV
blocks still in use once all is done (from /metrics), and how many requests were sent,
answered, errored as expected, and lost (no complete answer and no error; the report
lists each lost request's kind and what came back). The run fails
(exit 1) on a lost request, KV blocks left in use, or growth over --max-growth (5%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

KINDS = ("chat", "chat_stream", "completion", "completion_stream", "n", "logprobs", "tools", "stop", "disconnect",
         "abort", "bad", "embedding", "image", "image_stream", "bad_image")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def checkpoint(arch: str) -> str:
    from portaserve.framework.checkpoint import portaserve_cache_dir
    from portaserve.models.checkpoints import write_checkpoint
    from portaserve.models.checkpoints_vl import write_llava

    folder = portaserve_cache_dir() / "soak" / f"{arch}-tiny-v1"
    if not (folder / "config.json").is_file():
        if arch == "LlavaForConditionalGeneration":
            write_llava(folder, "tiny", 0)
        else:
            write_checkpoint(arch, "tiny", folder, 0)
    return str(folder)


def image_url(rng: random.Random) -> str:
    """A data: URL of a random PNG; a few seeds recur, so repeated images hit the encoder cache."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    seed = rng.randrange(8) if rng.random() < 0.5 else rng.randrange(10**9)
    gen = np.random.default_rng(seed)
    size = (int(gen.integers(8, 300)), int(gen.integers(8, 300)), 3)
    buf = io.BytesIO()
    Image.fromarray(gen.integers(0, 256, size, dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Server:
    def __init__(self, model: str, name: str, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "portaserve.framework.cli", "serve", model, "--host", "127.0.0.1", "--port",
               str(self.port), "--served-model-name", name, "--disable-uvicorn-access-log", "--uvicorn-log-level",
               "warning", *extra]
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"soak-{name}-{self.port}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s; see {self.log.name}")

    def rss(self) -> int:
        return tree_rss(self.proc.pid)

    def kv_usage(self) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("portaserve:kv_cache_usage_perc"):
                return float(line.split()[-1])
        return float("nan")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(30)
        except Exception:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
BAD = [
    {"messages": []},
    {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
    {"messages": [{"role": "user", "content": "x"}], "n": 10**12},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9},
    {"messages": "not a list"},
]


def judge(good: bool, kind: str, r: httpx.Response, notes: list[str], verdict: str = "ok") -> str:
    """`verdict` when the answer is good, else "lost", noting what came back (a lost
    request's kind and answer are in the report, to tell a flake from a bug)."""
    if good:
        return verdict
    try:
        body = r.text[-300:]
    except httpx.ResponseNotRead:  # a stream
        body = "(stream)"
    notes.append(f"{kind}: HTTP {r.status_code}: {body}")
    return "lost"


async def one(kind: str, gen: Server, emb: Server, rng: random.Random, client: httpx.AsyncClient,
              notes: list[str]) -> str:
    """Send one request of `kind`; returns "ok", "error" (an expected error answer) or "lost"
    (noted in `notes`)."""
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "soak", "test", "tokens"]) for _ in range(rng.randint(2, 40)))
    messages = [{"role": "user", "content": words}]
    chat, comp = gen.url + "/v1/chat/completions", gen.url + "/v1/completions"
    max_tokens = rng.randint(1, 24)
    try:
        if kind in ("chat", "n", "logprobs", "tools", "stop"):
            body: dict = {"model": "gen", "messages": messages, "max_tokens": max_tokens, "temperature": 0.8}
            if kind == "n":
                body["n"] = rng.randint(2, 4)
            if kind == "logprobs":
                body.update(logprobs=True, top_logprobs=3)
            if kind == "tools":
                body.update(tools=[TOOL], tool_choice="auto")
            if kind == "stop":
                body.update(stop=["a", "b e"], max_tokens=24)
            r = await client.post(chat, json=body)
            return judge(r.status_code == 200 and r.json()["choices"], kind, r, notes)
        if kind == "completion":
            r = await client.post(comp, json={"model": "gen", "prompt": words, "max_tokens": max_tokens, "echo": True,
                                              "logprobs": 2})
            return judge(r.status_code == 200 and r.json()["choices"], kind, r, notes)
        if kind in ("chat_stream", "completion_stream"):
            url, body = (chat, {"messages": messages}) if kind == "chat_stream" else (comp, {"prompt": words})
            body.update(model="gen", max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    await r.aread()  # the error body, for the report
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return judge(r.status_code == 200 and lines and lines[-1] == "data: [DONE]", kind, r, notes)
        if kind == "disconnect":
            body = {"model": "gen", "messages": messages, "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with client.stream("POST", chat, json=body) as r:
                async for line in r.aiter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        break  # leave mid-stream
            return judge(r.status_code == 200, kind, r, notes)
        if kind == "abort":
            try:
                await client.post(comp, json={"model": "gen", "prompt": words, "max_tokens": 200, "ignore_eos": True},
                                  timeout=0.2)
            except httpx.TimeoutException:
                pass  # the client gave up: the server must abort the request
            return "ok"
        if kind == "bad":
            r = await client.post(chat, json={"model": "gen", **rng.choice(BAD)})
            ok = r.status_code == 400 and r.json().get("error", {}).get("code") == 400
            return judge(ok, kind, r, notes, "error")
        if kind in ("image", "image_stream"):
            parts = [{"type": "text", "text": words}]
            parts += [{"type": "image_url", "image_url": {"url": image_url(rng)}} for _ in range(rng.randint(1, 2))]
            body = {"model": "gen", "messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens}
            if kind == "image":
                r = await client.post(chat, json=body)
                return judge(r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 16, kind, r, notes)
            body.update(stream=True)
            async with client.stream("POST", chat, json=body) as r:
                if r.status_code != 200:
                    await r.aread()  # the error body, for the report
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            return judge(r.status_code == 200 and lines and lines[-1] == "data: [DONE]", kind, r, notes)
        if kind == "bad_image":
            broken = rng.choice(["data:image/png;base64,bm90IGFuIGltYWdl", "data:image/png;base64,%%%",
                                 "file:///etc/passwd", "http://169.254.169.254/latest/meta-data"])
            parts = [{"type": "text", "text": words}, {"type": "image_url", "image_url": {"url": broken}}]
            r = await client.post(chat, json={"model": "gen", "messages": [{"role": "user", "content": parts}]})
            err = r.json().get("error", {}) if r.status_code == 400 else {}
            return judge("messages[0].content[1]" in err.get("message", ""), kind, r, notes, "error")
        if kind == "embedding":
            inputs = [words] * rng.randint(1, 4)
            r = await client.post(emb.url + "/v1/embeddings", json={"model": "emb", "input": inputs})
            return judge(r.status_code == 200 and len(r.json()["data"]) == len(inputs), kind, r, notes)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        notes.append(f"{kind}: {type(exc).__name__}: {exc}"[:400])
        return "lost"
    raise ValueError(kind)


async def run_mix(num: int, concurrency: int, gen: Server, emb: Server, seed: int, on_half=None) -> dict[str, int]:
    rng = random.Random(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(num)]
    rng.shuffle(kinds)
    counts: dict = {"sent": 0, "ok": 0, "error": 0, "lost": 0, "lost_details": []}
    queue: asyncio.Queue = asyncio.Queue()
    for k in kinds:
        queue.put_nowait(k)
    done = 0
    half_taken = False

    async def worker(i: int) -> None:
        nonlocal done, half_taken
        async with httpx.AsyncClient(timeout=120) as client:
            while not queue.empty():
                kind = queue.get_nowait()
                counts["sent"] += 1
                counts[await one(kind, gen, emb, random.Random(rng.random()), client, counts["lost_details"])] += 1
                done += 1
                if on_half is not None and not half_taken and done >= num // 2:
                    half_taken = True
                    on_half()

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return counts


def settle(servers: list[Server], timeout: float = 60) -> dict[str, float]:
    """Wait until no KV block is in use on any server; returns the last readings."""
    deadline = time.monotonic() + timeout
    usage = {}
    while time.monotonic() < deadline:
        usage = {s.url: s.kv_usage() for s in servers}
        if all(u == 0.0 for u in usage.values()):
            break
        time.sleep(0.5)
    return usage


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--warmup", type=int, default=None, help="warm-up requests (default: two of each kind per worker)")
    p.add_argument("--max-growth", type=float, default=0.05, help="allowed RSS growth from halfway to the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here too")
    args = p.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    gen = Server(checkpoint("LlavaForConditionalGeneration"), "gen",
                 ["--max-model-len", "512", "--max-num-seqs", "32", "--enable-auto-tool-choice", "--tool-call-parser",
                  "hermes", "--limit-mm-per-prompt", '{"image": 2}'])
    emb = Server(checkpoint("BertModel"), "emb", [])
    servers = [gen, emb]
    try:
        for s in servers:
            s.wait_ready()
        warmup = args.warmup if args.warmup is not None else 2 * len(KINDS) * args.concurrency
        started = time.monotonic()
        warm = asyncio.run(run_mix(warmup, args.concurrency, gen, emb, args.seed + 1))
        settle(servers)
        rss_warm = {s.url: s.rss() for s in servers}
        rss_half: dict[str, int] = {}
        counts = asyncio.run(run_mix(args.requests, args.concurrency, gen, emb, args.seed,
                                     on_half=lambda: rss_half.update({s.url: s.rss() for s in servers})))
        usage = settle(servers)
        rss_end = {s.url: s.rss() for s in servers}
        elapsed = time.monotonic() - started
    finally:
        for s in servers:
            s.stop()
    growth = {url: (rss_end[url] - rss_half[url]) / rss_half[url] for url in rss_end}
    report = {
        "requests": args.requests, "concurrency": args.concurrency, "warmup": warmup, "seconds": round(elapsed, 1),
        "sent": counts["sent"], "answered": counts["ok"], "errored": counts["error"], "lost": counts["lost"],
        "warmup_lost": warm["lost"],
        # what came back for each lost request (its kind first), the first 20 of each round
        "lost_details": counts["lost_details"][:20], "warmup_lost_details": warm["lost_details"][:20],
        "servers": {name: {"rss_mib_after_warmup": round(rss_warm[s.url] / 2**20, 1),
                           "rss_mib_halfway": round(rss_half[s.url] / 2**20, 1),
                           "rss_mib_end": round(rss_end[s.url] / 2**20, 1),
                           "growth_halfway_to_end_pct": round(100 * growth[s.url], 2),
                           "kv_cache_usage_after": usage.get(s.url)}
                    for name, s in (("generate", gen), ("embed", emb))},
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    failed = (counts["lost"] or warm["lost"] or any(u != 0.0 for u in usage.values())
              or any(g > args.max_growth for g in growth.values()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
