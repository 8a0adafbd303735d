"""Conformance: the platform's default KV-cache allocator sizes, allocates and moves blocks."""

from __future__ import annotations

import pytest
import torch

from portaserve.framework.interfaces import KVCacheAllocator


@pytest.fixture(scope="module")
def allocator(registry, platform, device) -> KVCacheAllocator:
    cls = registry.get("kv_cache_allocators", platform.default_kv_cache_allocator())
    return cls(device)


@pytest.fixture(scope="module")
def dtypes(platform):
    # Two layers in different dtypes the platform supports (the same one twice if only one).
    order = (torch.bfloat16, torch.float16, torch.float32)
    supported = [d for d in order if d in platform.capabilities().dtypes]
    return [supported[0], supported[-1]]


@pytest.mark.parametrize(
    ("budget", "per_block"),
    [(0, 4096), (4095, 4096), (4096, 4096), (10 * 4096 + 7, 4096), (2**30, 2 * 32 * 16 * 128 * 2), (2**34 + 1, 786432)],
)
def test_num_blocks_fits_the_budget(allocator, budget, per_block):
    n = allocator.num_blocks(budget, per_block)
    assert isinstance(n, int) and n >= 0
    assert n * per_block <= budget, f"{n} blocks of {per_block} B exceed the budget of {budget} B"
    # An allocator may keep headroom, but not waste more than a tenth of a large budget.
    if budget // per_block >= 100:
        assert n >= 0.9 * (budget // per_block)


def test_num_blocks_is_monotonic(allocator):
    counts = [allocator.num_blocks(b, 1000) for b in range(0, 200_000, 9_973)]
    assert counts == sorted(counts)


def test_num_blocks_rejects_nonsense(allocator):
    with pytest.raises(ValueError):
        allocator.num_blocks(1000, 0)
    with pytest.raises(ValueError):
        allocator.num_blocks(-1, 100)


def _shapes(allocator, num_blocks: int):
    shape_a = [num_blocks, 2, 2, 16, 8]
    shape_b = [num_blocks, 2, 1, 8, 16]
    # block ids index allocator.block_dim; build shapes with num_blocks there.
    for shape in (shape_a, shape_b):
        shape[0], shape[allocator.block_dim] = shape[allocator.block_dim], shape[0]
    return [tuple(shape_a), tuple(shape_b)]


def test_allocate_shapes_dtypes_device(allocator, device, dtypes):
    shapes = _shapes(allocator, 6)
    caches = allocator.allocate(shapes, dtypes)
    assert len(caches) == 2
    for cache, shape, dtype in zip(caches, shapes, dtypes):
        assert tuple(cache.shape) == shape and cache.dtype == dtype
        assert cache.device.type == device.type and cache.is_contiguous()
    caches[0].fill_(1)
    caches[1].fill_(2)
    assert bool((caches[0] == 1).all()), "layers share storage"
    allocator.release(caches)
    assert caches == []
    with pytest.raises(ValueError):
        allocator.allocate(shapes, dtypes[:1])


def test_blocks_round_trip_through_host_memory(allocator, device, dtypes):
    num_blocks = 8
    shapes = _shapes(allocator, num_blocks)
    caches = allocator.allocate(shapes, dtypes)
    gen = torch.Generator().manual_seed(0)
    originals = []
    for cache in caches:
        values = torch.randn(cache.shape, generator=gen).to(cache.dtype)
        cache.copy_(values.to(device))
        originals.append(values)
    block_ids = [5, 0, 3]
    dim = allocator.block_dim
    index = torch.tensor(block_ids)
    host = allocator.copy_blocks_to_host(caches, block_ids)
    for saved, values in zip(host, originals):
        assert saved.device.type == "cpu"
        assert torch.equal(saved, values.index_select(dim, index)), "host copy differs from the blocks"
    for cache in caches:
        cache.zero_()
    allocator.copy_blocks_from_host(caches, host, block_ids)
    for cache, values in zip(caches, originals):
        back = cache.to("cpu")
        assert torch.equal(back.index_select(dim, index), values.index_select(dim, index)), "blocks not restored"
        others = torch.tensor(sorted(set(range(num_blocks)) - set(block_ids)))
        assert not back.index_select(dim, others).any(), "blocks outside block_ids were written"


def test_budget_to_allocation(allocator, platform):
    # The engine's path: budget -> bytes per block -> number of blocks -> tensors.
    budget = platform.kv_cache_budget_bytes(1 / 1024)  # 1 MiB
    shape = _shapes(allocator, 1)[0]
    per_block = 2 * 2 * 16 * 8 * 4  # one block of the first layer shape in float32
    n = allocator.num_blocks(budget, per_block)
    assert n > 0
    (cache,) = allocator.allocate(_shapes(allocator, n)[:1], [torch.float32])
    assert cache.shape[allocator.block_dim] == n and len(shape) == cache.dim()
    assert cache.numel() * cache.element_size() <= budget
