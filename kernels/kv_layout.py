"""The paged KV-cache layout shared by the Triton kernels and their references.

One layer's cache is one tensor `[num_blocks, 2, num_kv_heads, block_size, head_size]`:
block ids index dim 0 (what the KV-cache allocator copies), dim 1 is K (0) or V (1).
Keeping a (block, K/V, head) tile contiguous lets the attention kernel read one head's
page as a single `block_size * head_size` run.
"""

from __future__ import annotations

import torch

KEY, VALUE = 0, 1


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    return (num_blocks, 2, num_kv_heads, block_size, head_size)


def check_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> int:
    """Validate a cache tensor's shape against the layout; returns its block size."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[2] != num_kv_heads or kv_cache.shape[4] != head_size:
        raise ValueError(
            f"kv_cache must be [num_blocks, 2, {num_kv_heads}, block_size, {head_size}], got {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache's last dimension must be contiguous")
    return kv_cache.shape[3]
