"""nova's KV-cache allocator: host tensors of whatever shape the attention backend declares.

The layout (``[2, num_blocks, ...]`` for nova_paged) is the backend's business: the
engine passes the backend's `kv_cache_shape` here and its `kv_cache_block_dim` to the
block copies (offload, sleep / wake), which the interface's defaults already implement.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from portaserve.framework.interfaces import KVCacheAllocator


class NovaKVCacheAllocator(KVCacheAllocator):
    name = "nova"
    platforms = frozenset({"nova"})

    def _allocate(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
        # Zero-filled, so the memory is committed at startup rather than during the first step.
        return [torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in zip(shapes, dtypes, strict=True)]
