"""Single-stream decode with speculative decoding against without, on the default model.

    python benchmarks/speculative.py [--k 4] [--max-tokens 128] [--repeats 3] [--draft-layers N]

Two engines side by side in one process (the default model, SmolLM2-135M-Instruct Q4_1;
one with `speculative_config={"method": "ngram", "num_speculative_tokens": k}`, or with
`--draft-layers N` a draft model: the default model's first N layers, written as a GGUF
file by models/truncated.py), greedy, one request at a time. Tasks:

- input-grounded: the model repeats or edits a given code snippet (its answer stops at
  the closing code fence), where the output copies the input;
- free-form chat: nothing in the prompt to copy.

Per task: the best time of `--repeats` runs of each engine (alternating), the speed-up,
the acceptance rate and the mean accepted length (tokens per speculating step), and
whether the two outputs are token-identical.
"""

from __future__ import annotations

import argparse
import sys
import time

CODE = '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def __len__(self):
        return len(self.items)
'''

TASKS = {
    "repeat code": ("Repeat this Python code exactly, without changes:\n\n" + CODE, True),
    "edit code (rename)": ("Rename the class Stack to LifoStack in this code and show the whole code:\n\n" + CODE, True),
    "free-form chat": ("Write a short story about a cat who learns to fly.", False),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--draft-layers", type=int, default=None, help="a draft model: the default model's first N layers")
    args = p.parse_args(argv)
    import tempfile
    from pathlib import Path

    from portaserve import LLM, SamplingParams
    from portaserve.framework.checkpoint import default_model_file
    from portaserve.models.truncated import truncate_checkpoint

    config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    label = "n-gram speculation"
    if args.draft_layers:
        draft = truncate_checkpoint(default_model_file(), Path(tempfile.mkdtemp()) / "draft.gguf", args.draft_layers)
        config, label = {"model": str(draft), "num_speculative_tokens": args.k}, f"a {args.draft_layers}-layer draft"
    plain, spec = LLM(max_model_len=2048), LLM(max_model_len=2048, speculative_config=config)
    rows = []
    for name, (text, grounded) in TASKS.items():
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, stop=["\n```"] if grounded else None)
        messages = [{"role": "user", "content": text}]
        best, outs = {}, {}
        for llm in (plain, spec):
            llm.chat(messages, params, use_tqdm=False)  # warm-up
        before = spec.llm_engine.stats()
        for _ in range(args.repeats):
            for key, llm in (("plain", plain), ("spec", spec)):
                start = time.perf_counter()
                out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
                elapsed = time.perf_counter() - start
                best[key] = min(best.get(key, elapsed), elapsed)
                outs[key] = list(out.token_ids)
        after = spec.llm_engine.stats()
        proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        drafts = after.spec_num_drafts - before.spec_num_drafts
        rows.append(f"| {name} | {len(outs['plain'])} | {best['plain'] * 1e3:.0f} | {best['spec'] * 1e3:.0f} | "
                    f"{best['plain'] / best['spec']:.2f}x | {accepted / max(1, proposed):.0%} | "
                    f"{1 + accepted / max(1, drafts):.2f} | {outs['plain'] == outs['spec']} |")
    print(f"{label}, k = {args.k}, greedy, one request (SmolLM2-135M-Instruct Q4_1):", file=sys.stderr)
    print("| task | tokens | without (ms) | with (ms) | speed-up | accepted | mean accepted length | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
