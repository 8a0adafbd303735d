"""`portaserve bench throughput`: offline generation through the Python API.

Synthetic prompts of exactly --input-len tokens generate exactly --output-len tokens
(EOS ignored), or prompts come from a local dataset. A short warm-up batch runs first
(so one-time costs such as compilation are not counted). Reports requests/s, output
tokens/s and total tokens/s.
"""

from __future__ import annotations

import argparse
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .common import add_engine_arguments

    add_engine_arguments(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dataset", default=None, help="local JSON/JSONL file of prompts (default: random token ids)")
    p.add_argument("--warmup-prompts", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", default=None)


def main(args: argparse.Namespace) -> int:
    from portaserve import LLM, SamplingParams

    from .common import dataset_prompts, emit, engine_kwargs, random_prompts, speculation_summary

    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs(args, args.num_prompts))
    startup = time.perf_counter() - t0
    vocab = llm.llm_engine.spec.vocab_size
    if args.dataset:
        rows = dataset_prompts(args.dataset, args.num_prompts)
        prompts = [r["prompt"] for r in rows]
        params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"] or args.output_len, ignore_eos=True) for r in rows]
    else:
        prompts = [{"prompt_token_ids": p} for p in random_prompts(args.num_prompts, args.input_len, vocab, args.seed)]
        params = [SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True) for _ in prompts]
    if args.warmup_prompts:
        warm = [{"prompt_token_ids": p} for p in random_prompts(args.warmup_prompts, args.input_len, vocab, args.seed + 1)]
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "benchmark": "throughput",
        "model": llm.llm_engine.spec.model_path,
        "num_prompts": len(outputs),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "elapsed_s": elapsed,
        "startup_s": startup,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "speculative_decoding": speculation_summary(llm.llm_engine.stats()),
        "plan": str(llm.plan),
    }
    emit(result, args.json)
    llm.shutdown()
    return 0
