"""GGUF matmul: `y = x @ W^T (+ b)` with W kept in the packed GGUF layout, dequantized in registers.

The GPU kernel of the "gguf" QuantMethod (framework/quantization/gguf.py), which imports
`gguf_matmul` where the platform declares the "triton" feature. The weight is read in the
layout `framework.quantization.gguf_layout.pack` leaves on the layer, the same one the
CPU's C kernel reads:

- a weight is `scale * code + min`, with one float16 scale and one float16 min per
  `group` (16 or 32) consecutive weights of a row: `scales`, `mins` are [N, K / group];
- `bits` 8: `qweight` is uint8 [N, K], the codes in order;
- `bits` 4: `qweight` is uint8 [N, K / 2]; each run of 32 weights of a row is 16 bytes,
  byte j holding weight j in its low nibble and weight 16 + j in its high one (ggml's own
  Q4_0 order). So weight k of a row sits in byte `(k // 32) * 16 + k % 16`, in the high
  nibble when `k % 32 >= 16`.

Why dequantize in the kernel: a decode step is bound by the bytes of weight it reads, and
the packed weight is 4.5 to 9 bits a weight (codes, plus 32 bits of scale and min per
group) against 16 for a bf16 copy. Each program computes a [BLOCK_M, BLOCK_N] tile of y:
per K tile it loads the codes of its BLOCK_N rows of W, turns them into weights
(`code * scale + min`, in float32), casts them to x's dtype and `tl.dot`s them with the x
tile, accumulating in float32. K is a whole number of 32-weight blocks but not always a
multiple of BLOCK_K: the last tile is masked (masked codes, scales and mins read as 0,
so they add nothing). Each K tile's scales and mins are gathered per weight rather than
per group: simpler, and the repeated addresses hit the cache.

No K split (unlike int8_matmul): plain M x N tiles, fixed by M and not autotuned (the
interpreter would run every config). `gguf_matmul` goes through the torch custom op
`portaserve::gguf_matmul`, so torch.compile and CUDA graphs see one opaque call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ._interpret import fix_interpreter_bf16_dot

if TYPE_CHECKING:
    from portaserve.framework.quantization.gguf_layout import PackedGGUF

fix_interpreter_bf16_dot()


@triton.jit
def _gguf_matmul_kernel(
    x_ptr,  # [M, K] activations
    q_ptr,  # [N, K / 2] (BITS 4) or [N, K] (BITS 8) uint8 codes
    scale_ptr,  # [N, K / GROUP] float16
    min_ptr,  # [N, K / GROUP] float16
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N] in x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = rows of W
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_cols = q_ptr + cols.to(tl.int64)[None, :] * stride_qn
    s_cols = scale_ptr + cols.to(tl.int64)[None, :] * stride_sn
    m_cols = min_ptr + cols.to(tl.int64)[None, :] * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_ok = k < K
        w_mask = k_ok[:, None] & col_ok[None, :]
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        # the codes of W^T's tile, [BLOCK_K, BLOCK_N]
        if BITS == 4:
            byte = (k // 32) * 16 + k % 16
            shift = (k % 32) // 16 * 4  # low nibble: weights 0..15 of the run; high: 16..31
            packed = tl.load(q_cols + byte[:, None], mask=w_mask, other=0).to(tl.int32)
            code = (packed >> shift[:, None]) & 0xF
        else:
            code = tl.load(q_cols + k[:, None], mask=w_mask, other=0).to(tl.int32)
        group = k // GROUP
        scale = tl.load(s_cols + group[:, None], mask=w_mask, other=0.0).to(tl.float32)
        low = tl.load(m_cols + group[:, None], mask=w_mask, other=0.0).to(tl.float32)
        w = code.to(tl.float32) * scale + low
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_sizes_for(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by the number of rows (as int8_matmul's)."""
    if m <= 16:
        return 16, 32, 128, 4
    if m <= 64:
        return triton.next_power_of_2(m), 64, 64, 4
    return 64, 128, 64, 8


def gguf_matmul_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bits: int,
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton launcher (no custom-op wrapper).

    :param x: [M, K] float16 / bfloat16 / float32, K a multiple of 32
    :param qweight: uint8 [N, K / 2] (bits 4) or [N, K] (bits 8), contiguous rows
    :param scales: float16 [N, K / group], contiguous rows (as `mins`)
    :param bits: 4 or 8
    :param group: 16 or 32
    :param bias: [N] or None
    :returns: [M, N] in x's dtype.
    """
    if bits not in (4, 8) or group not in (16, 32):
        raise ValueError(f"bits must be 4 or 8 and group 16 or 32; got bits={bits}, group={group}")
    if x.dim() != 2 or qweight.dim() != 2:
        raise ValueError(f"x must be [M, K] and qweight [N, K / 2 or K]; got {tuple(x.shape)}, {tuple(qweight.shape)}")
    m, k = x.shape
    n = qweight.shape[0]
    if k % 32 or qweight.shape[1] * (2 if bits == 4 else 1) != k:
        raise ValueError(f"x [M, K] needs K a multiple of 32 matching the {bits}-bit qweight {tuple(qweight.shape)}; got {tuple(x.shape)}")
    if tuple(scales.shape) != (n, k // group) or tuple(mins.shape) != (n, k // group) or scales.stride() != mins.stride():
        raise ValueError(f"scales and mins must both be [{n}, {k // group}] alike; got {tuple(scales.shape)}, {tuple(mins.shape)}")
    if qweight.dtype != torch.uint8 or qweight.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError("qweight must be uint8, and qweight, scales and mins contiguous in their last dimension")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}]; got {tuple(bias.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k, num_warps = block_sizes_for(m)
    _gguf_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x,
        qweight,
        scales,
        mins,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        out.stride(0),
        BITS=bits,
        GROUP=group,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=num_warps,
    )
    return out


@torch.library.custom_op("portaserve::gguf_matmul", mutates_args=())
def gguf_matmul_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bits: int,
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gguf_matmul_triton` as an opaque torch op (arguments as there)."""
    return gguf_matmul_triton(x, qweight, scales, mins, bits, group, bias)


@gguf_matmul_op.register_fake
def _(x, qweight, scales, mins, bits, group, bias=None):
    return x.new_empty((x.shape[0], qweight.shape[0]))


def gguf_matmul(x: torch.Tensor, packed: PackedGGUF, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ the packed weight's [N, K]^T (+ bias [N]) -> [M, N] in x's dtype.

    The "gguf" QuantMethod's Triton matmul (`GGUFMethod._prepare` picks it).
    """
    return gguf_matmul_op(x, packed.qweight, packed.scales, packed.mins, packed.bits, packed.group, bias)
