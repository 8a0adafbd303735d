"""Rotary position embedding of q and k, neox and gpt-j styles, from a cos/sin cache.

`cos_sin_cache: [max_position, rotary_dim]` holds cos in its first half and sin in its
second, row = position. A head's first `rotary_dim` elements rotate in pairs — (i,
i + rotary_dim/2) in neox style, (2i, 2i + 1) in gpt-j style — pair i by angle i;
the rest of the head (partial rotary) passes through. One program per token handles
every head of q and of k, so the cos/sin row is loaded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpret import fix_interpreter_bf16_dot

fix_interpreter_bf16_dot()


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    token,
    stride_st,
    stride_sh,
    stride_dt,
    stride_dh,
    cos,
    sin,
    num_heads,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)
    pairs = tl.arange(0, HALF_PAD)
    if IS_NEOX:
        first = pairs
        second = pairs + HALF
    else:
        first = 2 * pairs
        second = 2 * pairs + 1
    mask = (heads < num_heads)[:, None] & (pairs < HALF)[None, :]
    src = src_ptr + token * stride_st + heads[:, None] * stride_sh
    dst = dst_ptr + token * stride_dt + heads[:, None] * stride_dh
    x1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    out_dtype = dst_ptr.dtype.element_ty
    tl.store(dst + first[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(out_dtype), mask=mask)
    tl.store(dst + second[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(out_dtype), mask=mask)
    if PASS_PAD > 0:  # partial rotary: copy the unrotated tail
        tail = 2 * HALF + tl.arange(0, PASS_PAD)
        tail_mask = (heads < num_heads)[:, None] & (tail < HEAD_SIZE)[None, :]
        rest = tl.load(src + tail[None, :], mask=tail_mask)
        tl.store(dst + tail[None, :], rest, mask=tail_mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cache,
    num_q_heads,
    num_k_heads,
    HEAD_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, HALF_PAD)
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + pairs, mask=pairs < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + pairs, mask=pairs < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin, num_q_heads,
                  HEAD_SIZE, HALF, Q_HEADS_PAD, HALF_PAD, PASS_PAD, IS_NEOX)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin, num_k_heads,
                  HEAD_SIZE, HALF, K_HEADS_PAD, HALF_PAD, PASS_PAD, IS_NEOX)


def _as_heads(t: torch.Tensor, rotary_dim: int, name: str) -> torch.Tensor:
    if t.dim() == 2:  # [num_tokens, num_heads * head_size] with head_size == rotary_dim
        if t.shape[1] % rotary_dim:
            raise ValueError(f"{name} width {t.shape[1]} is not a multiple of the rotary dim {rotary_dim}")
        t = t.unflatten(1, (t.shape[1] // rotary_dim, rotary_dim))
    if t.dim() != 3:
        raise ValueError(f"{name} must be [num_tokens, num_heads, head_size], got {tuple(t.shape)}")
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _buffer(given: torch.Tensor | None, like: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    if given is None:
        return torch.empty(heads.shape, dtype=heads.dtype, device=heads.device)
    if given.shape != like.shape or not given.is_contiguous():
        raise ValueError(f"output buffers must be contiguous with shape {tuple(like.shape)}")
    return given.view(heads.shape)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their tokens' positions; the inputs are not modified.

    :param positions: [num_tokens] int
    :param q: [num_tokens, num_heads, head_size], or [num_tokens, num_heads * head_size]
        when head_size equals the rotary dim
    :param k: like q, with num_kv_heads heads
    :param cos_sin_cache: [max_position, rotary_dim], cos then sin
    :param q_out, k_out: optional contiguous buffers (q's and k's shapes) to write into
    :returns: (q, k) rotated, new tensors of the input shapes and dtypes
    """
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2:
        raise ValueError(f"the rotary dim must be even, got {rotary_dim}")
    q3, k3 = _as_heads(q, rotary_dim, "q"), _as_heads(k, rotary_dim, "k")
    head_size = q3.shape[-1]
    if k3.shape[-1] != head_size or rotary_dim > head_size:
        raise ValueError(f"q and k need one head size >= rotary dim {rotary_dim}; got {head_size}, {k3.shape[-1]}")
    if positions.shape != (q3.shape[0],) or k3.shape[0] != q3.shape[0]:
        raise ValueError(f"positions must be [num_tokens={q3.shape[0]}], got {tuple(positions.shape)}")
    q_out = _buffer(q_out, q, q3)
    k_out = _buffer(k_out, k, k3)
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    half = rotary_dim // 2
    if q3.shape[0]:
        passthrough = head_size - rotary_dim
        _rotary_kernel[(q3.shape[0],)](
            positions,
            q3,
            k3,
            q_out,
            k_out,
            cos_sin_cache,
            q3.stride(0),
            q3.stride(1),
            k3.stride(0),
            k3.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            cos_sin_cache.stride(0),
            q3.shape[1],
            k3.shape[1],
            HEAD_SIZE=head_size,
            HALF=half,
            Q_HEADS_PAD=triton.next_power_of_2(q3.shape[1]),
            K_HEADS_PAD=triton.next_power_of_2(k3.shape[1]),
            HALF_PAD=triton.next_power_of_2(half),
            PASS_PAD=triton.next_power_of_2(passthrough) if passthrough else 0,
            IS_NEOX=bool(is_neox),
            num_warps=4 if q3.shape[1] * head_size >= 2048 else 1,
        )
    return q_out.view(q.shape), k_out.view(k.shape)


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference in float64 (same arguments; returns float64 tensors of q's and k's shapes)."""
    rotary_dim = cos_sin_cache.shape[-1]
    half = rotary_dim // 2
    cs = cos_sin_cache.double()[positions.long()]  # [num_tokens, rotary_dim]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x3 = _as_heads(x, rotary_dim, "x").double()
        rot, rest = x3[..., :rotary_dim], x3[..., rotary_dim:]
        if is_neox:
            x1, x2 = rot[..., :half], rot[..., half:]
            rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([rotated, rest], dim=-1).view(x.shape)

    return rotate(q), rotate(k)
