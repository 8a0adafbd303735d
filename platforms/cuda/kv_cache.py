"""KV cache in GPU memory (CUDA; the ROCm allocator reuses it, torch's HIP build shares the API)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from portaserve.framework.interfaces import KVCacheAllocator


class CudaKVCacheAllocator(KVCacheAllocator):
    name = "cuda"
    platforms = frozenset({"cuda"})

    def _allocate(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
        # empty, not zeros: a multi-GiB memset costs startup time, and every slot is
        # written (reshape_and_cache) before attention reads it.
        return [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in zip(shapes, dtypes, strict=True)]

    def _copy_blocks_along(self, caches, block_ids, device: torch.device, block_dims) -> list[torch.Tensor]:
        index = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        out = []
        for cache, dim in zip(caches, block_dims, strict=True):
            blocks = cache.index_select(dim, index)
            # Pinned host memory makes the copy back (copy_blocks_from_host) asynchronous.
            host = torch.empty(blocks.shape, dtype=blocks.dtype, device=device, pin_memory=device.type == "cpu")
            host.copy_(blocks)
            out.append(host)
        return out
