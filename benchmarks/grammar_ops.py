"""Structured outputs' per-step pieces, alone: the token mask (`apply_token_bitmask`, the
torch reference against the CPU platform's C kernel) and each backend's compile time and
bitmask fill time per sequence, inside a JSON string (the costliest place: most tokens
are allowed), on the Qwen2 vocabulary (151,936 ids) with the conformance kit's schema.

    python benchmarks/grammar_ops.py [--rows 32] [--repeats 20]

Each time is the best of --repeats runs (fills: of 4, each in a new grammar state).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)

    import torch

    from portaserve.framework.interfaces.structured_output import Constraint, bitmask_words
    from portaserve.framework.op_references import apply_token_bitmask
    from portaserve.framework.plugins import get_registry
    from portaserve.framework.testing.structured_checks import SCHEMA, qwen2_vocab
    from portaserve.platforms.cpu.fused_ops import apply_token_bitmask as cpu_c

    vocab, tok = qwen2_vocab()
    v = vocab.vocab_size
    logits = torch.randn(args.rows, v)
    mask = torch.randint(-(2**31), 2**31 - 1, (args.rows, bitmask_words(v)), dtype=torch.int64).to(torch.int32)
    print(f"apply_token_bitmask, {args.rows} x {v}:")
    print(f"  torch reference  {best(lambda: apply_token_bitmask(logits, mask), args.repeats) * 1e3:.2f} ms")
    work = logits.clone()
    print(f"  cpu_c            {best(lambda: cpu_c(work, mask), args.repeats) * 1e3:.2f} ms")

    registry = get_registry()
    prefix = tok.encode('{"name": "Ad', add_special_tokens=False).ids  # inside a JSON string
    print(f"backends, the kit's schema, {args.rows} sequences inside a JSON string:")
    for name in ("xgrammar", "llguidance"):
        cls = registry.get("structured_output_backends", name)
        if cls.unavailable_reason() is not None:
            print(f"  {name}: {cls.unavailable_reason()}")
            continue
        backend = cls(vocab)
        constraint = Constraint("json", json.dumps(SCHEMA), compact_json=True)
        compile_s = best(lambda: backend.compile(constraint), 3)
        compiled = backend.compile(constraint)
        matchers = [compiled.matcher() for _ in range(args.rows)]
        for m in matchers:
            for t in prefix:
                m.accept_token(t)
        bitmask = torch.zeros(args.rows, bitmask_words(v), dtype=torch.int32)
        letter = tok.encode("a", add_special_tokens=False).ids[0]

        def fresh_fill(fill) -> float:
            # each fill in a new state (one more letter in the string): a backend may cache
            # the mask of a state it has already seen
            times = []
            for _ in range(4):
                for m in matchers:
                    m.accept_token(letter)
                start = time.perf_counter()
                fill()
                times.append(time.perf_counter() - start)
            return min(times)

        one_by_one = fresh_fill(lambda: [m.fill_bitmask(bitmask, r) for r, m in enumerate(matchers)])
        together = fresh_fill(lambda: backend.fill_bitmasks(matchers, bitmask))
        print(f"  {name:10s} compile {compile_s * 1e3:.1f} ms; fill {one_by_one / args.rows * 1e6:.0f} us/row one by one, "
              f"{together / args.rows * 1e6:.0f} us/row through fill_bitmasks (a new state each fill)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
