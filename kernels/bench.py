"""`portaserve bench kernels`: time each Triton kernel on the current device.

Each kernel runs on several input sets used in turn (together larger than any
last-level cache, so no call is served from the previous call's cache), `--warmup`
calls first (compilation included), then `--iters` calls each timed with a pair of device
events; the median is reported with the bytes and FLOPs the call must at least move and
compute, as GB/s and TFLOP/s, next to the device's own measured copy bandwidth and
matmul rate (also medians of event-timed runs). These are the numbers to record in
BENCHMARKS.md.

The device comes from the platform registry (`--device auto`, a platform name, or
NAME:LOCAL_RANK), as the engine would choose it. On a machine without a GPU it needs the
Triton interpreter: with `TRITON_INTERPRET=1` (the CPU platform then declares the "triton"
feature) it runs every kernel once on tiny shapes (wall-clock timing; a smoke test of the
kernels and of this tool, not a performance number); without it, it says so and exits
with 2.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ._interpret import interpreting

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: Bytes of input sets cycled through per kernel: above the largest L2 / Infinity Cache.
ROTATION_BYTES = 512 * 2**20
MAX_SETS = 16


@dataclass(frozen=True, slots=True)
class Shapes:
    """The model shape the kernels are timed at (Llama-3-8B attention and MLP by default)."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    hidden: int = 4096
    intermediate: int = 14336
    num_tokens: int = 4096  # tokens of the token-parallel kernels (a prefill-sized step)
    # attention steps: (name, [(cached_prefix, query_len)] per sequence)
    attention_steps: tuple = (
        ("decode 64 x ctx 2048", ((2047, 1),) * 64),
        ("decode 8 x ctx 8192 (split-K)", ((8191, 1),) * 8),
        ("prefill 4 x 1024", ((0, 1024),) * 4),
        ("chunk 512 on prefix 3584", ((3584, 512),)),
        ("mixed: chunk 512 + 63 decodes ctx 1024", ((512, 512),) + ((1023, 1),) * 63),
    )
    copy_elements: int = 256 * 2**20
    matmul_size: int = 8192


#: Interpreter shapes: every kernel and code path once, in seconds.
TINY = Shapes(
    num_heads=4,
    num_kv_heads=2,
    head_size=64,
    block_size=16,
    hidden=128,
    intermediate=256,
    num_tokens=8,
    attention_steps=(
        ("decode 2 x ctx 40", ((39, 1),) * 2),
        ("decode 1 x ctx 300 (split-K)", ((299, 1),)),
        ("chunk 8 on prefix 20", ((20, 8),)),
    ),
    copy_elements=2**20,
    matmul_size=256,
)


@dataclass(frozen=True, slots=True)
class Result:
    kernel: str
    shape: str
    median_us: float
    bytes: int
    flops: int

    @property
    def gbps(self) -> float:
        return self.bytes / (self.median_us * 1e-6) / 1e9

    @property
    def tflops(self) -> float:
        return self.flops / (self.median_us * 1e-6) / 1e12


def has_timing_events(device: torch.device) -> bool:
    """Whether `device` records timing events (accelerators do; the CPU refuses to)."""
    try:
        torch.Event(device=device, enable_timing=True).record()
    except RuntimeError:
        return False
    return True


class Timer:
    """Median seconds per call: device events where the device has them, else wall clock."""

    def __init__(self, device: torch.device, sync: Callable[[], None]) -> None:
        self.device = device
        self.sync = sync  # waits for the device's queued work
        self.uses_events = has_timing_events(device)

    def median(self, fn: Callable, sets: list[tuple], iters: int, warmup: int) -> float:
        for i in range(warmup):
            fn(*sets[i % len(sets)])
        self.sync()
        if self.uses_events:
            pairs = [(self._event(), self._event()) for _ in range(iters)]
            for i, (start, end) in enumerate(pairs):
                args = sets[(warmup + i) % len(sets)]
                start.record()
                fn(*args)
                end.record()
            self.sync()
            return statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3
        times = []
        for i in range(iters):
            args = sets[(warmup + i) % len(sets)]
            t0 = time.perf_counter()
            fn(*args)
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def _event(self) -> torch.Event:
        return torch.Event(device=self.device, enable_timing=True)


def num_sets(bytes_per_set: int) -> int:
    """Input sets to cycle through so their total passes ROTATION_BYTES (2..MAX_SETS)."""
    return max(2, min(MAX_SETS, math.ceil(ROTATION_BYTES / max(bytes_per_set, 1))))


# ----- the device's own rates --------------------------------------------------------------


def measure_copy_gbps(timer: Timer, shapes: Shapes, iters: int, warmup: int) -> float:
    device = timer.device
    src = torch.empty(shapes.copy_elements, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = timer.median(lambda: dst.copy_(src), [()], iters, warmup)
    return 2 * src.numel() * 4 / seconds / 1e9  # read + write


def measure_matmul_tflops(timer: Timer, shapes: Shapes, dtype: torch.dtype, iters: int, warmup: int) -> float:
    n = shapes.matmul_size
    a = torch.randn(n, n, device=timer.device).to(dtype)
    b = torch.randn(n, n, device=timer.device).to(dtype)
    seconds = timer.median(lambda: a @ b, [()], iters, warmup)
    return 2 * n**3 / seconds / 1e12


# ----- the kernels ---------------------------------------------------------------------------


def _paged_inputs(steps, shapes: Shapes, dtype, device, gen):
    """One attention input set: cache with shuffled blocks, tables, q (all on device)."""
    from .kv_layout import kv_cache_shape

    bs = shapes.block_size
    seq_lens = [c + q for c, q in steps]
    pages = [-(-n // bs) for n in seq_lens]
    perm = torch.randperm(sum(pages), generator=gen)
    table = torch.zeros(len(steps), max(pages), dtype=torch.int32)
    at = 0
    for i, p in enumerate(pages):
        table[i, :p] = perm[at : at + p].to(torch.int32)
        at += p
    cache = torch.randn(kv_cache_shape(sum(pages), bs, shapes.num_kv_heads, shapes.head_size), device=device).to(dtype)
    qsl = torch.zeros(len(steps) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for _c, q in steps]), 0)
    q = torch.randn(int(qsl[-1]), shapes.num_heads, shapes.head_size, device=device).to(dtype)
    return q, cache, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device), qsl.to(device)


def attention_cost(steps, shapes: Shapes, element_size: int) -> tuple[int, int]:
    """(bytes, flops) a paged-attention call must at least move / do: each sequence's K/V
    read once per KV head, q read and out written once; QK^T and PV over causal pairs."""
    kv_tokens = sum(c + q for c, q in steps)
    num_tokens = sum(q for _c, q in steps)
    kv_bytes = kv_tokens * 2 * shapes.num_kv_heads * shapes.head_size * element_size
    qo_bytes = 2 * num_tokens * shapes.num_heads * shapes.head_size * element_size
    pairs = sum(q * c + q * (q + 1) // 2 for c, q in steps)
    return kv_bytes + qo_bytes, 4 * pairs * shapes.num_heads * shapes.head_size


def bench_attention(timer, shapes, dtype, iters, warmup) -> list[Result]:
    from .paged_attention import paged_attention, plan_work
    from .triton_backend import target_programs

    gen = torch.Generator().manual_seed(0)
    elt = torch.empty((), dtype=dtype).element_size()
    results = []
    for name, steps in shapes.attention_steps:
        nbytes, flops = attention_cost(steps, shapes, elt)
        sets = [_paged_inputs(steps, shapes, dtype, timer.device, gen) for _ in range(num_sets(nbytes))]
        work = plan_work(
            [q for _c, q in steps],
            max(c + q for c, q in steps),
            shapes.num_kv_heads,
            shapes.num_heads // shapes.num_kv_heads,
            shapes.head_size,
            timer.device,
            target_programs=target_programs(timer.device),
        )
        scale = shapes.head_size**-0.5

        def run(q, cache, table, seq_lens, qsl, work=work, scale=scale):
            paged_attention(q, cache, table, seq_lens, qsl, work, scale)

        seconds = timer.median(run, sets, iters, warmup)
        label = f"{name} [splits={work.num_splits}]"
        results.append(Result("paged_attention", label, seconds * 1e6, nbytes, flops))
        del sets
    return results


def bench_elementwise(timer, shapes, dtype, iters, warmup) -> list[Result]:
    from .activation import silu_and_mul
    from .kv_layout import kv_cache_shape
    from .reshape_and_cache import reshape_and_cache
    from .rms_norm import fused_add_rms_norm, rms_norm
    from .rotary import rotary_embedding

    dev, t = timer.device, shapes.num_tokens
    elt = torch.empty((), dtype=dtype).element_size()

    def rand(*shape):
        return torch.randn(*shape, device=dev).to(dtype)

    results = []

    def case(kernel, shape, nbytes, make, fn):
        sets = [make() for _ in range(num_sets(nbytes))]
        seconds = timer.median(fn, sets, iters, warmup)
        results.append(Result(kernel, shape, seconds * 1e6, nbytes, 0))

    h, hkv, d = shapes.num_heads, shapes.num_kv_heads, shapes.head_size
    kv_bytes = 2 * t * hkv * d * elt
    num_blocks = -(-t // shapes.block_size)
    case(
        "reshape_and_cache",
        f"{t} tokens x {hkv} kv heads x {d}",
        2 * kv_bytes + 8 * t,
        lambda: (
            rand(t, hkv, d),
            rand(t, hkv, d),
            torch.empty(kv_cache_shape(num_blocks, shapes.block_size, hkv, d), dtype=dtype, device=dev),
            torch.randperm(num_blocks * shapes.block_size, device=dev)[:t],
        ),
        reshape_and_cache,
    )
    hid = shapes.hidden
    w = rand(hid)
    case("rms_norm", f"{t} x {hid}", 2 * t * hid * elt, lambda: (rand(t, hid),), lambda x: rms_norm(x, w, 1e-6))
    case(
        "fused_add_rms_norm",
        f"{t} x {hid}",
        4 * t * hid * elt,
        lambda: (rand(t, hid), rand(t, hid)),
        lambda x, r: fused_add_rms_norm(x, r, w, 1e-6),
    )
    inter = shapes.intermediate
    case("silu_and_mul", f"{t} x 2*{inter}", 3 * t * inter * elt, lambda: (rand(t, 2 * inter),), silu_and_mul)
    max_pos = 8192
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=dev) / d))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32, device=dev), inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    rope_bytes = 2 * t * (h + hkv) * d * elt + t * d * 4 + 8 * t
    case(
        "rotary_embedding (neox)",
        f"{t} tokens x {h}+{hkv} heads x {d}",
        rope_bytes,
        lambda: (torch.randint(0, max_pos, (t,), device=dev), rand(t, h, d), rand(t, hkv, d)),
        lambda pos, q, k: rotary_embedding(pos, q, k, cos_sin, True),
    )
    return results


# ----- entry point ----------------------------------------------------------------------------


def open_platform(device: str):
    """The platform `--device` names ("auto", a platform name, or NAME:LOCAL_RANK), set up to
    compute on that local rank's device as a worker would be; returns (platform, local rank)."""
    from portaserve.framework import device_properties
    from portaserve.framework.errors import invalid
    from portaserve.framework.plugins import get_registry
    from portaserve.framework.selection import choose_platform

    name, _, index = device.partition(":")
    if index and not index.isdigit():
        raise invalid("device", f"expected auto, a platform name or NAME:LOCAL_RANK, got {device!r}")
    local_rank = int(index or 0)
    platform = choose_platform(get_registry(), name).instantiate()
    platform.init_worker(local_rank)
    device_properties.publish(platform, local_rank)  # the compute units kernels size grids by
    return platform, local_rank


def main(args: argparse.Namespace) -> int:
    """Run the kernel benchmark; options: `portaserve bench kernels --help` (framework/cli/bench.py)."""
    platform, local_rank = open_platform(args.device)
    device = platform.torch_device(local_rank)
    if "triton" not in platform.capabilities().features:
        print(
            f"portaserve bench kernels: platform {platform.name} has no 'triton' feature (no GPU here, or triton is "
            "not installed). The Triton kernels need a CUDA, ROCm or XPU device; set TRITON_INTERPRET=1 for a "
            "smoke run on tiny shapes under the Triton interpreter (it checks the kernels run, it measures nothing).",
            file=sys.stderr,
        )
        return 2
    smoke = interpreting()
    for param in ("iters", "warmup"):
        value = getattr(args, param)
        if value is not None and value < (1 if param == "iters" else 0):
            from portaserve.framework.errors import invalid

            raise invalid(param, f"must be >= {1 if param == 'iters' else 0}, got {value}")
    iters = args.iters if args.iters is not None else (1 if smoke else 100)
    warmup = args.warmup if args.warmup is not None else (1 if smoke else 10)
    dtype = DTYPES[args.dtype]
    shapes = TINY if smoke else Shapes()
    timer = Timer(device, lambda: platform.synchronize(local_rank))

    copy_gbps = measure_copy_gbps(timer, shapes, iters, warmup)
    matmul_tflops = measure_matmul_tflops(timer, shapes, dtype, iters, warmup)
    results = bench_elementwise(timer, shapes, dtype, iters, warmup) + bench_attention(timer, shapes, dtype, iters, warmup)

    clock = "device events" if timer.uses_events else "wall clock"
    print(f"device {device} ({platform.info.device_name}), dtype {args.dtype}, {iters} timed calls after {warmup} warm-up, {clock}")
    if smoke:
        print("TRITON_INTERPRET=1: tiny shapes through the interpreter; the numbers below are not performance")
    print(f"reference: copy {copy_gbps:.1f} GB/s, matmul {matmul_tflops:.2f} TFLOP/s ({args.dtype}, n={shapes.matmul_size})")
    print(f"{'kernel':<26}{'shape':<48}{'median us':>11}{'GB/s':>9}{'%copy':>7}{'TFLOP/s':>9}{'%mm':>6}")
    for r in results:
        flop_cols = f"{r.tflops:>9.2f}{100 * r.tflops / matmul_tflops:>6.1f}" if r.flops else f"{'-':>9}{'-':>6}"
        print(f"{r.kernel:<26}{r.shape:<48}{r.median_us:>11.1f}{r.gbps:>9.1f}{100 * r.gbps / copy_gbps:>7.1f}{flop_cols}")
    if args.json:
        payload = {
            "device": str(device),
            "device_name": platform.info.device_name,
            "dtype": args.dtype,
            "iters": iters,
            "warmup": warmup,
            "timing": clock,
            "interpreter": smoke,
            "copy_gbps": copy_gbps,
            "matmul_tflops": matmul_tflops,
            "results": [{**asdict(r), "gbps": r.gbps, "tflops": r.tflops} for r in results],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0
