"""A backend's KV-cache layout, checked and viewed through the interface alone.

The attention backend owns the layout (`kv_cache_shape`, `kv_cache_block_dim`); the kit
never assumes block ids index dimension 0. `check_kv_layout` verifies the declaration
is coherent (the block dimension is where the shape grows with the number of blocks,
and nowhere else), so a wrong `kv_cache_block_dim` fails with a message about the
declaration instead of an IndexError deep inside a check; `blocks_view` is the cache
seen block-major, whatever the layout.
"""

from __future__ import annotations

import torch


def check_kv_layout(backend, num_blocks: int) -> int:
    """Verify `backend.kv_cache_shape` against `backend.kv_cache_block_dim`; returns the block dim.

    :raises AssertionError: with what is inconsistent.
    """
    name = getattr(backend, "name", type(backend).__name__)
    dim = backend.kv_cache_block_dim
    shape = tuple(backend.kv_cache_shape(num_blocks))
    grown = tuple(backend.kv_cache_shape(num_blocks + 1))
    if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim < len(shape):
        raise AssertionError(f"{name}: kv_cache_block_dim is {dim!r}, not a dimension of kv_cache_shape {shape}")
    changed = [i for i, (a, b) in enumerate(zip(shape, grown)) if a != b]
    if len(shape) != len(grown) or changed != [dim] or shape[dim] != num_blocks:
        raise AssertionError(
            f"{name}: kv_cache_shape({num_blocks}) = {shape} and kv_cache_shape({num_blocks + 1}) = {grown}, "
            f"but kv_cache_block_dim is {dim}: the block dimension must have size num_blocks and be the only "
            "one that changes with it (declare kv_cache_block_dim where block ids index the cache)"
        )
    return dim


def blocks_view(cache: torch.Tensor, block_dim: int) -> torch.Tensor:
    """`cache` with the block dimension moved first (a view: writes go to the cache)."""
    return cache.movedim(block_dim, 0)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether `dtype` is a one-byte float (an fp8 KV cache)."""
    return dtype.is_floating_point and torch.empty((), dtype=dtype).element_size() == 1
