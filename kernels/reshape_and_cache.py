"""Write the new tokens' K and V into their paged-cache slots (`reshape_and_cache`).

One program per token copies all of its KV heads; a slot is `block * block_size + offset`.
The layout is `kernels.kv_layout`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpret import fix_interpreter_bf16_dot
from .kv_layout import KEY, VALUE, check_kv_cache

fix_interpreter_bf16_dot()


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ckv,
    stride_ch,
    stride_cs,
    num_kv_heads,
    HEAD_SIZE: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # int64: block * stride_cb overflows int32 once the cache passes 2^31 elements
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_SIZE)[None, :]
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    dst = cache_ptr + block * stride_cb + heads[:, None] * stride_ch + offset * stride_cs + dims[None, :]
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int | None = None,
) -> None:
    """Store `key`/`value` rows into `kv_cache` at `slot_mapping` (in place).

    :param key: [num_tokens, num_kv_heads, head_size]
    :param value: [num_tokens, num_kv_heads, head_size]
    :param kv_cache: [num_blocks, 2, num_kv_heads, block_size, head_size]
    :param slot_mapping: [num_tokens] int, flat slot of each token
    :param num_tokens: write only the first `num_tokens` rows (the rest are padding).
    """
    _check(key, value, kv_cache, slot_mapping)
    count = key.shape[0] if num_tokens is None else num_tokens
    if count == 0:
        return
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    block_size = kv_cache.shape[3]
    _reshape_and_cache_kernel[(count,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_kv_heads,
        HEAD_SIZE=head_size,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=block_size,
        # a copy: one warp per token moves a few KiB; more warps only add idle lanes
        num_warps=1 if num_kv_heads * head_size <= 1024 else 4,
    )


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int | None = None,
) -> None:
    """Torch reference of `reshape_and_cache` (same arguments, in place)."""
    _check(key, value, kv_cache, slot_mapping)
    count = key.shape[0] if num_tokens is None else num_tokens
    block_size = kv_cache.shape[3]
    for t in range(count):
        slot = int(slot_mapping[t])
        block, offset = divmod(slot, block_size)
        kv_cache[block, KEY, :, offset, :] = key[t].to(kv_cache.dtype)
        kv_cache[block, VALUE, :, offset, :] = value[t].to(kv_cache.dtype)


def _check(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_size]; got {tuple(key.shape)}, {tuple(value.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in their last dimension")
    check_kv_cache(kv_cache, key.shape[1], key.shape[2])
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < key.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens >= {key.shape[0]}], got {tuple(slot_mapping.shape)}")
