"""`portaserve bench serve --base-url URL`: load an OpenAI-compatible server.

Works against any server that speaks `/v1/completions` with streaming (portaserve,
vLLM, ...), so one command measures both. Prompts are token-id lists of exactly
--input-len tokens; each asks for exactly --output-len tokens (`ignore_eos`). Requests
arrive as a Poisson process at --request-rate (inf = all at once), at most
--max-concurrency in flight. Reports TTFT, TPOT, ITL and end-to-end latency
(mean / median / p99), request and token throughput, as JSON, with an optional PNG plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=150000, help="upper bound for random prompt token ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-prompts", type=int, default=2)
    p.add_argument("--json", metavar="PATH", default=None)
    p.add_argument("--plot", metavar="PNG", default=None, help="write latency distributions (needs matplotlib)")
    p.add_argument("--timeout", type=float, default=600.0)


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def _one(client, url: str, model: str, prompt: list[int], output_len: int, headers: dict) -> RequestResult:
    res = RequestResult(start=time.perf_counter(), prompt_tokens=len(prompt))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                res.end = time.perf_counter()
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"].get("completion_tokens", res.output_tokens)
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - res.start
                    res.chunk_times.append(now)
        res.end = time.perf_counter()
        res.ok = True
        if not res.output_tokens:
            res.output_tokens = len(res.chunk_times)
    except Exception as exc:  # reported per request, the run goes on
        res.error = f"{type(exc).__name__}: {exc}"
        res.end = time.perf_counter()
    return res


async def run(args: argparse.Namespace) -> dict:
    import httpx
    from tqdm.auto import tqdm

    from .common import random_prompts, summarize

    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get(f"{base}/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        url = f"{base}/v1/completions"
        for p in random_prompts(args.warmup_prompts, args.input_len, args.vocab_size, args.seed + 1):
            await _one(client, url, model, p, 4, headers)
        prompts = random_prompts(args.num_prompts, args.input_len, args.vocab_size, args.seed)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(prompts), desc="requests", dynamic_ncols=True)
        rng = random.Random(args.seed)

        async def limited(p):
            if sem is None:
                out = await _one(client, url, model, p, args.output_len, headers)
            else:
                async with sem:
                    out = await _one(client, url, model, p, args.output_len, headers)
            bar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "benchmark": "serve",
        "base_url": base,
        "model": model,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_s": summarize([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": summarize([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": summarize([x for r in ok for x in r.itls]),
        "e2e_s": summarize([r.e2e for r in ok]),
    }
    if args.plot:
        _plot(ok, args.plot)
    return summary


def _plot(results: list[RequestResult], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'portaserve[bench]'") from exc
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    series = {
        "TTFT (ms)": [r.ttft * 1e3 for r in results if r.ttft is not None],
        "ITL (ms)": [x * 1e3 for r in results for x in r.itls],
        "E2E (s)": [r.e2e for r in results],
    }
    for ax, (label, values) in zip(axes, series.items()):
        ax.hist(values, bins=40)
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: argparse.Namespace) -> int:
    from .common import emit

    result = asyncio.run(run(args))
    emit(result, args.json)
    return 0 if result["failed"] == 0 else 1
