"""The CPU KV cache: zeros that cost nothing to allocate (fresh anonymous mappings), backed
page by page as steps write them, and handed back to the OS when released."""

from __future__ import annotations

import gc
import resource

import torch

from portaserve.platforms.cpu.kv_cache import HostKVCacheAllocator


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_large_cache_is_zero_and_touches_no_page_until_written():
    allocator = HostKVCacheAllocator(torch.device("cpu"))
    shapes = [(2048, 2, 16, 2, 64)] * 4  # 4 layers x 16 MiB of bfloat16
    before = _minor_faults()
    caches = allocator.allocate(shapes, [torch.bfloat16] * 4)
    assert _minor_faults() - before < 256  # torch.zeros would fault in all 4096 pages of each layer
    for cache, shape in zip(caches, shapes):
        assert cache.shape == shape and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not any(bool(c[::97].any()) for c in caches)
    caches[1][5].fill_(1.5)  # one block written: its pages only
    assert float(caches[1][5].float().mean()) == 1.5 and not bool(caches[1][4].any()) and not bool(caches[0][5].any())
    assert caches[1].untyped_storage().data_ptr() != caches[0].untyped_storage().data_ptr()
    allocator.release(caches)
    assert caches == []
    gc.collect()


def test_a_small_cache_is_zero_too():
    allocator = HostKVCacheAllocator(torch.device("cpu"))
    (cache,) = allocator.allocate([(4, 2, 16, 1, 8)], [torch.float32])
    assert cache.shape == (4, 2, 16, 1, 8) and not bool(cache.any())
    cache += 1
    assert bool((cache == 1).all())
