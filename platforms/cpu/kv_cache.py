"""KV cache in host memory."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from portaserve.framework.interfaces import KVCacheAllocator


class HostKVCacheAllocator(KVCacheAllocator):
    name = "cpu"
    platforms = frozenset({"cpu"})

    def _allocate(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
        # zeros, not empty: pages are touched now rather than during the first step,
        # and stale memory never masquerades as cached K/V.
        return [torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in zip(shapes, dtypes, strict=True)]
