"""The example device's KV cache: host tensors, zero-filled."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from portaserve.framework.interfaces import KVCacheAllocator


class ExampleKVCacheAllocator(KVCacheAllocator):
    name = "example"
    platforms = frozenset({"example"})

    def _allocate(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
        # Zero-filled so pages are committed at startup rather than during the first step.
        return [torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in zip(shapes, dtypes, strict=True)]
