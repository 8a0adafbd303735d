"""KV cache in TPU HBM, allocated on the process's XLA device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from portaserve.framework.interfaces import KVCacheAllocator


class XlaKVCacheAllocator(KVCacheAllocator):
    name = "tpu"
    platforms = frozenset({"tpu"})

    def _allocate(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
        # XLA materializes tensors lazily; empty keeps startup from tracing a fill per layer.
        return [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in zip(shapes, dtypes, strict=True)]
