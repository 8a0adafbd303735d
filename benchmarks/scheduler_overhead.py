"""Cost of the scheduler's own work per step: schedule() + update_from_output().

No model runs: a stub "runner" returns one sampled token per request, so the numbers
are pure engine-core bookkeeping (block allocation, prefix-hash registration, stop
checks, building the SchedulerOutput). Also times one block hash for each algorithm.

    .venv/bin/python benchmarks/scheduler_overhead.py [--batch 64] [--steps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from portaserve.framework.engine.block_manager import BlockManager, _builtin_block_hash, _sha256_block_hash
from portaserve.framework.engine.params import SamplingParams
from portaserve.framework.engine.request import Request
from portaserve.framework.engine.scheduler import Scheduler
from portaserve.framework.engine.scheduler_output import ModelRunnerOutput


def bench_steps(batch: int, steps: int, prompt_len: int, block_size: int, hash_algo: str) -> float:
    num_blocks = batch * (prompt_len + steps + 64) // block_size + 16
    bm = BlockManager(num_blocks, block_size, hash_algo=hash_algo)
    sched = Scheduler(
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=8192,
        max_model_len=prompt_len + steps + 64,
        block_size=block_size,
        block_manager=bm,
    )
    for i in range(batch):
        sched.add_request(
            Request(f"r{i}", [(i * 7 + j) % 30000 for j in range(prompt_len)], SamplingParams(max_tokens=steps + 16),
                    eos_token_ids=frozenset({2}), max_tokens=steps + 16)
        )

    def run(so):
        return ModelRunnerOutput(sampled_token_ids={rid: 100 + (len(rid) % 50) for rid in so.num_scheduled_tokens})

    so = sched.schedule()  # the prefill step, not timed
    sched.update_from_output(so, run(so))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        out = run(so)
        t2 = time.perf_counter()
        sched.update_from_output(so, out)
        times.append((t1 - t0) + (time.perf_counter() - t2))
    assert sched.stats().num_running == batch
    # median: robust to other processes preempting this one on a shared machine
    return statistics.median(times) * 1e6


def bench_hash(fn, root, block_size: int, n: int = 2000, repeats: int = 7) -> float:
    tokens = list(range(1000, 1000 + block_size))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        h = root
        for _ in range(n):
            h = fn(h, tokens, None)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def calibration_us() -> float:
    """Time of a fixed pure-Python loop, to compare numbers across machines (~10 us on a fast desktop core)."""
    best = float("inf")
    for _ in range(50):
        t0 = time.perf_counter()
        sum(range(1000))
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    print(f"calibration: sum(range(1000)) takes {calibration_us():.1f} us on this machine")
    for algo in ("sha256", "builtin"):
        us = bench_steps(args.batch, args.steps, args.prompt_len, args.block_size, algo)
        print(f"schedule+update, {args.batch} running decodes, hash={algo}: {us:.1f} us/step ({us / args.batch:.2f} us/request)")
    print(f"one block hash ({args.block_size} tokens): sha256 {bench_hash(_sha256_block_hash, b'x' * 32, args.block_size):.2f} us, "
          f"builtin {bench_hash(_builtin_block_hash, 0, args.block_size):.2f} us")


if __name__ == "__main__":
    main()
