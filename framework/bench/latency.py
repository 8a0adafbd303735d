"""`portaserve bench latency`: one batch, end to end, with per-step times.

Runs --num-iters batches of --batch-size prompts (after --warmup-iters) through the
engine step by step, timing the prefill step(s) and every decode step, and splitting
each step into model time and engine overhead (scheduling, sampling bookkeeping,
detokenization).
"""

from __future__ import annotations

import argparse
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .common import add_engine_arguments

    add_engine_arguments(p)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--warmup-iters", type=int, default=1)
    p.add_argument("--json", metavar="PATH", default=None)


def main(args: argparse.Namespace) -> int:
    from portaserve import LLM, SamplingParams

    from .common import emit, engine_kwargs, random_prompts, speculation_summary, summarize

    llm = LLM(args.model, **engine_kwargs(args, args.batch_size))
    engine = llm.llm_engine
    executor = engine.core.executor
    model_time = [0.0]
    inner = executor.execute_model

    def timed_execute(sched):
        t = time.perf_counter()
        try:
            return inner(sched)
        finally:
            model_time[0] += time.perf_counter() - t

    executor.execute_model = timed_execute
    vocab = engine.spec.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    latencies, prefill_times, decode_times, overhead_shares = [], [], [], []
    for it in range(args.warmup_iters + args.num_iters):
        prompts = random_prompts(args.batch_size, args.input_len, vocab, seed=it)
        for j, p in enumerate(prompts):
            engine.add_request(f"lat-{it}-{j}", {"prompt_token_ids": p}, params)
        start = time.perf_counter()
        steps = []
        step_model = []
        generated = 0
        while engine.has_unfinished_requests():
            model_time[0] = 0.0
            t = time.perf_counter()
            outs = engine.step()
            steps.append(time.perf_counter() - t)
            step_model.append(model_time[0])
            generated += sum(1 for o in outs for c in o.outputs)
        total = time.perf_counter() - start
        if it < args.warmup_iters:
            continue
        latencies.append(total)
        # the steps until every prompt has its first token are prefill; the rest decode
        num_prefill = max(1, -(-args.batch_size * args.input_len // max(1, engine.core.scheduler.max_num_batched_tokens)))
        prefill_times.append(sum(steps[:num_prefill]))
        decode = steps[num_prefill:]
        decode_times.extend(decode)
        busy = sum(steps)
        overhead_shares.append((busy - sum(step_model)) / busy if busy else 0.0)
    result = {
        "benchmark": "latency",
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "latency_s": summarize(latencies),
        "prefill_s": summarize(prefill_times),
        "decode_step_s": summarize(decode_times),
        "decode_tokens_per_s": args.batch_size / summarize(decode_times)["median"] if decode_times else None,
        "engine_overhead_share": summarize(overhead_shares),
        "speculative_decoding": speculation_summary(engine.stats()),
        "plan": str(llm.plan),
    }
    emit(result, args.json)
    llm.shutdown()
    return 0
