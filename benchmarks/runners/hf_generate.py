"""transformers' `generate` on a batch of token-id prompts (runs in the project venv).

Prints one JSON line: elapsed seconds of the timed generate calls and token counts.
"""

import argparse
import json
import random
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--num-prompts", type=int, required=True)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    startup = time.perf_counter() - t0
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size - 1000
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    with torch.inference_mode():
        warm = torch.tensor(prompts[:1])
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out_tokens = 0
        for i in range(0, len(prompts), args.batch_size):
            ids = torch.tensor(prompts[i : i + args.batch_size])  # equal lengths: no padding needed
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=0,
            )
            out_tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        elapsed = time.perf_counter() - start
    print(json.dumps({"system": "transformers", "elapsed_s": elapsed, "startup_s": startup, "output_tokens": out_tokens,
                      "prompt_tokens": args.num_prompts * args.input_len, "num_prompts": args.num_prompts}))


if __name__ == "__main__":
    main()
