"""The `KVCacheAllocator` interface: sizing and allocating the paged KV cache.

The block manager (pure Python) hands out block ids; the allocator owns the memory
those ids index: how many blocks fit a budget, the physical per-layer tensors, and
moving blocks between device and host memory (offload, sleep / wake). The layout of
each tensor (its shape, and which dimension blocks are) belongs to the layer's attention
backend: the allocator allocates the shapes it is given and moves blocks along the
dimensions it is told.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch


class KVCacheAllocator(ABC):
    """Allocates KV-cache tensors on one device."""

    name: ClassVar[str]
    platforms: ClassVar[frozenset[str]]

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def num_blocks(self, budget_bytes: int, bytes_per_block: int) -> int:
        """How many blocks fit `budget_bytes` when one block (all layers) takes `bytes_per_block`."""
        if bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        return self._num_blocks(budget_bytes, bytes_per_block)

    def allocate(
        self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]
    ) -> list[torch.Tensor]:
        """Allocate one tensor per layer with the given shapes and dtypes (contents undefined)."""
        if len(shapes) != len(dtypes):
            raise ValueError(f"{len(shapes)} shapes but {len(dtypes)} dtypes")
        return self._allocate(shapes, dtypes)

    def copy_blocks_to_host(
        self, caches: Sequence[torch.Tensor], block_ids: Sequence[int], block_dims: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """Copy the given blocks of every layer into host memory; returns one tensor per layer.

        :param block_dims: per cache, the dimension block ids index: the attention
            backend's `kv_cache_block_dim` (the backend owns the layout). None: 0 for all.
        """
        return self._copy_blocks_along(caches, block_ids, torch.device("cpu"), _dims(caches, block_dims))

    def copy_blocks_from_host(
        self,
        caches: Sequence[torch.Tensor],
        host: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        block_dims: Sequence[int] | None = None,
    ) -> None:
        """Write host copies (from `copy_blocks_to_host`) back into the given blocks."""
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        for cache, saved, dim in zip(caches, host, _dims(caches, block_dims), strict=True):
            saved = saved.to(self.device, non_blocking=True)
            if cache.element_size() == 1:  # fp8 caches: index_copy_ has no float8 kernels; bytes do
                cache, saved = cache.view(torch.uint8), saved.view(torch.uint8)
            cache.index_copy_(dim, index, saved)

    def release(self, caches: list[torch.Tensor]) -> None:
        """Free the tensors (the engine drops its references afterwards)."""
        caches.clear()

    def _num_blocks(self, budget_bytes: int, bytes_per_block: int) -> int:
        return budget_bytes // bytes_per_block

    @abstractmethod
    def _allocate(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]: ...

    def _copy_blocks_along(self, caches, block_ids, device: torch.device, block_dims: Sequence[int]) -> list[torch.Tensor]:
        """Copy blocks out along each cache's block dimension (contract 1.1). A block-major
        request goes to `_copy_blocks`, which 1.0 allocators override."""
        if not any(block_dims):
            return self._copy_blocks(caches, block_ids, device)
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        return [cache.index_select(dim, index).to(device) for cache, dim in zip(caches, block_dims, strict=True)]

    def _copy_blocks(self, caches, block_ids, device: torch.device) -> list[torch.Tensor]:
        """Copy blocks of block-major caches (block ids index dimension 0)."""
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        return [cache.index_select(0, index).to(device) for cache in caches]


def _dims(caches: Sequence[torch.Tensor], block_dims: Sequence[int] | None) -> list[int]:
    dims = [0] * len(caches) if block_dims is None else list(block_dims)
    if len(dims) != len(caches):
        raise ValueError(f"{len(caches)} caches but {len(dims)} block dims")
    return dims
