"""`portaserve make-checkpoint ARCH OUT [--size tiny|small|bench] [--seed N] [--dtype D]`:
write a deterministic random-weight checkpoint in Hugging Face format.

The writer comes from the plugin registry (`portaserve_checkpoint_writers`), so an
architecture a plugin adds can bring its own test checkpoint. Sizes: tiny for tests,
small for the demo, bench (Qwen2-0.5B-shaped, about 1 GB) for benchmarks.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from portaserve.framework.errors import invalid

SIZES = ("tiny", "small", "bench")
DTYPES = ("float32", "bfloat16", "float16")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "make-checkpoint",
        help="write a random-weight checkpoint (HF format, real tokenizer) for tests, demos, benchmarks",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("arch", metavar="ARCH", help="architecture name as in config.json, e.g. Qwen2ForCausalLM")
    p.add_argument("out", metavar="OUT", help="output folder (created)")
    p.add_argument("--size", choices=SIZES, default="tiny", help="tiny (tests, default), small (demo), bench")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0): same seed, same weights")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="storage dtype (default: the size's own)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from portaserve.framework.plugins import get_registry  # torch: only for this command

    registry = get_registry()
    known = registry.names("checkpoint_writers")
    if args.arch not in known:
        raise invalid("arch", f"arch: no checkpoint writer for {args.arch!r}; available: {', '.join(known) or 'none'}")
    writer = registry.get("checkpoint_writers", args.arch)
    out = Path(args.out)
    start = time.perf_counter()
    if args.dtype is None:
        writer(str(out), args.size, args.seed)
    else:
        writer(str(out), args.size, args.seed, dtype=args.dtype)
    print(f"wrote {args.arch} ({args.size}, seed {args.seed}) to {out} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    print(out)
    return 0
