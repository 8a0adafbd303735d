"""The `KVCacheAllocator` interface: sizing and allocating the paged KV cache.

The block manager (pure Python) hands out block ids; the allocator owns the tensors
those ids index: how many blocks fit a budget, the physical per-layer tensors, and
moving blocks between device and host memory (offload, sleep / wake).
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

    def copy_blocks_to_host(self, caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Copy the given blocks of every layer into host memory; returns one tensor per layer.

        Block ids index dimension `block_dim` of each cache tensor.
        """
        return self._copy_blocks(caches, block_ids, torch.device("cpu"))

    def copy_blocks_from_host(
        self, caches: Sequence[torch.Tensor], host: Sequence[torch.Tensor], block_ids: Sequence[int]
    ) -> None:
        """Write host copies (from `copy_blocks_to_host`) back into the given blocks."""
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        for cache, saved in zip(caches, host, strict=True):
            cache.index_copy_(self.block_dim, index, saved.to(self.device, non_blocking=True))

    def release(self, caches: list[torch.Tensor]) -> None:
        """Free the tensors (the engine drops its references afterwards)."""
        caches.clear()

    #: Dimension of a cache tensor that block ids index.
    block_dim: ClassVar[int] = 0

    def _num_blocks(self, budget_bytes: int, bytes_per_block: int) -> int:
        return budget_bytes // bytes_per_block

    @abstractmethod
    def _allocate(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]: ...

    def _copy_blocks(self, caches, block_ids, device: torch.device) -> list[torch.Tensor]:
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        return [cache.index_select(self.block_dim, index).to(device) for cache in caches]
