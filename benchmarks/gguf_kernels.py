"""The CPU's GGUF matmul by rows of x: the int8 dot products (ps_gguf_matmul), the bf16
small-batch GEMM that expands 4 weight rows at a time in L1 (ps_gguf_gemm), and the
weight dequantized to bf16 then oneDNN's GEMM (ps_gguf_dequantize + F.linear), on the four
matmuls of one SmolLM2-135M layer (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536), per GGUF type. Where they cross are `gguf_linear.GEMM_ROWS` and
`DEQUANTIZE_ROWS`.

    python benchmarks/gguf_kernels.py [--types Q4_1,Q8_0] [--rows 1,4,8,16,32,64] [--threads 2]

Prints ms per layer (best of --reps) for each path and row count.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from portaserve.framework.gguf.blocks import decompose, random_blocks
from portaserve.framework.quantization.gguf_layout import pack
from portaserve.platforms.cpu import native
from portaserve.platforms.cpu.gguf_linear import _DTYPES, gguf_matmul
from portaserve.platforms.cpu.host_allocator import keep_freed_memory

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def _best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", default="Q4_1,Q8_0")  # K-quants need K % 256 == 0: not these shapes
    p.add_argument("--rows", default="1,4,8,16,32,64")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the engine's CPU worker does: no page faults on each fresh weight buffer
    kernels = native.load()
    rng = np.random.default_rng(0)
    print("| type | rows | int8 dot products | small-batch bf16 GEMM | dequantize + oneDNN GEMM |")
    print("|---|---|---|---|---|")
    for type_name in args.types.split(","):
        layer = [pack(*(torch.from_numpy(a) for a in decompose(random_blocks(type_name, n, k, rng), type_name, (n, k))))
                 for n, k in SHAPES]
        for m in map(int, args.rows.split(",")):
            xs = [torch.randn(m, k).to(torch.bfloat16) for _n, k in SHAPES]

            def int8():
                for x, packed in zip(xs, layer):
                    gguf_matmul(kernels, x, packed, None)

            def dequant():
                for x, packed in zip(xs, layer):
                    n, k = packed.shape
                    w = torch.empty(n, k, dtype=torch.bfloat16)
                    kernels.gguf_dequantize(packed.qweight.data_ptr(), packed.bits, packed.group, packed.scales.data_ptr(),
                                            packed.mins.data_ptr(), n, k, w.data_ptr(), _DTYPES[torch.bfloat16],
                                            args.threads)
                    torch.nn.functional.linear(x, w)

            def gemm():
                for x, packed in zip(xs, layer):
                    n, k = packed.shape
                    y = torch.empty(m, n, dtype=torch.bfloat16)
                    kernels.gguf_gemm(x.data_ptr(), k, 1, m, k, packed.qweight.data_ptr(), packed.bits, packed.group,
                                      packed.scales.data_ptr(), packed.mins.data_ptr(), n, None, y.data_ptr(), n, 1,
                                      args.threads)

            a, g, b = (_best(f, args.reps) * 1e3 for f in (int8, gemm, dequant))
            print(f"| {type_name} | {m} | {a:.3f} | {g:.3f} | {b:.3f} |", flush=True)


if __name__ == "__main__":
    main()
