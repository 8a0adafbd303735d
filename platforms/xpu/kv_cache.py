"""KV cache in Intel GPU memory."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from portaserve.framework.interfaces import KVCacheAllocator


class XpuKVCacheAllocator(KVCacheAllocator):
    name = "xpu"
    platforms = frozenset({"xpu"})

    def _allocate(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
        # empty: every slot is written before attention reads it, and a memset of the
        # whole budget would only cost startup time.
        return [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in zip(shapes, dtypes, strict=True)]
