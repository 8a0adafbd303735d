"""Int8 weight-only matmul: `y = (x @ q^T) * s (+ b)` with int8 weights, per-output-channel scales.

The GPU kernel of the "int8" QuantMethod (framework/quantization/int8_kernels.py).
Weights stay int8 in memory and are widened to the activation dtype tile by tile in
registers, so a decode step reads half the bytes of a bf16 weight; the products
accumulate in float32 and the per-channel scale is applied once, on the output tile.

Grid: (M tiles, N tiles, K splits). Decode has few rows (M = batch size) and layers as
narrow as 896 outputs, which would leave most of a GPU's SMs idle, so below the target
program count the reduction over K is split too: each split writes a float32 partial
and the partials are summed (then scaled) afterwards. Configs are fixed by M, not
autotuned, for the same reason as paged_attention's (the interpreter runs every one).

`int8_weight_only_mm` is registered as the torch custom op `portaserve::int8_weight_only_mm`
so torch.compile and CUDA graphs see one opaque call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpret import fix_interpreter_bf16_dot

fix_interpreter_bf16_dot()

MAX_SPLIT_K = 8
#: A split must cover at least this many K tiles, else its partial write costs more than it saves.
MIN_TILES_PER_SPLIT = 2


@triton.jit
def _int8_weight_only_mm_kernel(
    x_ptr,  # [M, K] activations
    w_ptr,  # [N, K] int8
    scale_ptr,  # [N] float32
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N] (SPLIT_K == 1) or [SPLIT_K, M, N] float32 partials
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    # this split's share of K, in whole tiles
    num_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(num_tiles, SPLIT_K)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    for tile in range(tile_lo, tile_hi):
        k = tile * BLOCK_K + ks
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0)  # [BLOCK_K, BLOCK_N] int8
        # |q| <= 127 is exact in every float dtype; widening through float32 also keeps the
        # interpreter right (its direct int8 -> bfloat16 cast yields wrong bits)
        acc += tl.dot(x, w.to(tl.float32).to(x.dtype), input_precision=DOT_PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        dst = out_ptr + split * stride_os + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(dst, acc, mask=mask)


def block_sizes_for(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by the number of rows."""
    if m <= 16:
        return 16, 32, 128, 4
    if m <= 64:
        return triton.next_power_of_2(m), 64, 64, 4
    return 64, 128, 64, 8


def choose_split_k(num_programs: int, k: int, block_k: int, target_programs: int) -> int:
    """Split K (a power of two) when the M x N tiles alone leave the device idle."""
    if num_programs >= target_programs:
        return 1
    max_splits = max(1, triton.cdiv(k, block_k) // MIN_TILES_PER_SPLIT)
    wanted = min(MAX_SPLIT_K, max_splits, triton.cdiv(target_programs, num_programs))
    return 1 << (wanted.bit_length() - 1) if wanted > 1 else 1


def _target_programs(device: torch.device) -> int:
    from .triton_backend import target_programs

    return target_programs(device)


def int8_weight_only_mm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    split_k: int | None = None,
) -> torch.Tensor:
    """The Triton launcher (no custom-op wrapper).

    :param x: [M, K] float16 / bfloat16 / float32
    :param weight: [N, K] int8, contiguous
    :param scale: [N] float32
    :param bias: [N] or None
    :param split_k: force the K split (tests); default from `choose_split_k`.
    :returns: [M, N] in x's dtype.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    if weight.dtype != torch.int8 or weight.stride(1) != 1:
        raise ValueError("weight must be int8 and contiguous in its last dimension")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, block_k, num_warps = block_sizes_for(m)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split_k is None:
        split_k = choose_split_k(tiles, k, block_k, _target_programs(x.device))
    elif not 1 <= split_k <= MAX_SPLIT_K or split_k & (split_k - 1):
        raise ValueError(f"split_k must be a power of two in [1, {MAX_SPLIT_K}], got {split_k}")
    target = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    _int8_weight_only_mm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)](
        x,
        weight,
        scale,
        bias if bias is not None else scale,
        target,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        target.stride(-2),
        target.stride(0) if split_k > 1 else 0,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=num_warps,
    )
    if split_k > 1:
        y = target.sum(0) * scale.float()
        if bias is not None:
            y += bias.float()
        out.copy_(y)
    return out


@torch.library.custom_op("portaserve::int8_weight_only_mm", mutates_args=())
def int8_weight_only_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`int8_weight_only_mm_triton` as an opaque torch op (shapes as there)."""
    return int8_weight_only_mm_triton(x, weight, scale, bias)


@int8_weight_only_mm.register_fake
def _(x, weight, scale, bias=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


def int8_weight_only_mm_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 torch reference: x [M, K], weight [N, K] int8, scale [N] -> [M, N] float64."""
    y = x.double() @ (weight.double() * scale.double()[:, None]).t()
    return y if bias is None else y + bias.double()
