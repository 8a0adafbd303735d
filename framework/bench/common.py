"""Shared pieces of the benchmarks: synthetic prompts, engine flags, result output."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder, GGUF file or hub id (default: the default model, "
                   "SmolLM2-135M-Instruct, as `portaserve serve` runs it)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the batch size")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None, help="prompt-token cap for steps with decodes "
                   "(default: none, as in the LLM API)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=float, default=None, help="GiB")
    p.add_argument("--quantization", default=None)
    p.add_argument("--compilation-mode", default=None, choices=("none", "default", "max"))
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-enable-prefix-caching", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, vLLM's keys: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                        "or '{\"model\": DRAFT_PATH, \"num_speculative_tokens\": 4}'")


def engine_kwargs(args: argparse.Namespace, batch: int) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "device": args.device,
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs or batch,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_prefix_caching": not args.no_enable_prefix_caching,
    }
    for name in ("max_num_batched_tokens", "max_prefill_tokens_with_decodes", "max_model_len", "kv_cache_memory", "quantization",
                 "compilation_mode", "attention_backend", "speculative_config"):
        value = getattr(args, name)
        if value is not None:
            kw[name] = value
    if args.enforce_eager:
        kw["enforce_eager"] = True
    return kw


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int = 0, low: int = 100) -> list[list[int]]:
    """Token-id prompts of exactly `input_len` tokens, distinct from the first token on
    (so the prefix cache does not turn a throughput run into a cache benchmark)."""
    rng = random.Random(seed)
    high = max(low + 1, vocab_size - 1000)
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(num)]


def dataset_prompts(path: str, num: int) -> list[dict[str, Any]]:
    """Prompts from a local JSON/JSONL file: a list of {"prompt": ..., "output_len": ...}
    (or ShareGPT-style {"conversations": [{"value": ...}, ...]})."""
    text = Path(path).read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()] if path.endswith(".jsonl") else json.loads(text)
    out = []
    for row in rows:
        if "prompt" in row:
            out.append({"prompt": row["prompt"], "output_len": row.get("output_len")})
        elif "conversations" in row and row["conversations"]:
            out.append({"prompt": row["conversations"][0]["value"], "output_len": row.get("output_len")})
        if len(out) >= num:
            break
    if not out:
        raise ValueError(f"dataset {path}: no rows with 'prompt' or 'conversations'")
    return out


def summarize(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}


def speculation_summary(stats: Any) -> dict[str, Any] | None:
    """Proposals, accepted tokens, acceptance rate and mean accepted length (tokens per
    step of a speculating request: accepted proposals + the sampled token), or None."""
    drafts = getattr(stats, "spec_num_drafts", 0)
    if not drafts:
        return None
    proposed, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
    return {"num_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0, "mean_accepted_length": 1 + accepted / drafts}


def emit(result: dict[str, Any], json_path: str | None) -> None:
    text = json.dumps(result, indent=2)
    if json_path:
        Path(json_path).write_text(text + "\n")
    print(text, file=sys.stdout)
