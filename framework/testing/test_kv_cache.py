"""Conformance: the platform's default KV-cache allocator sizes, allocates and moves blocks
of the layouts its attention backends declare (:mod:`.kv_cache_checks`)."""

from __future__ import annotations

import pytest

from portaserve.framework.interfaces import KVCacheAllocator
from portaserve.framework.testing.kv_cache_checks import (
    check_allocation,
    check_budget_to_allocation,
    check_round_trip,
    representative_layers,
)


@pytest.fixture(scope="module")
def allocator(registry, platform, device) -> KVCacheAllocator:
    cls = registry.get("kv_cache_allocators", platform.default_kv_cache_allocator())
    return cls(device)


@pytest.fixture(scope="module")
def layers(registry, platform, device):
    """Attention backend instances whose `kv_cache_shape` / `kv_cache_block_dim` the checks use."""
    found, notes = representative_layers(registry, platform, device)
    if not found:
        pytest.fail(f"no attention backend of {platform.name} gives a KV-cache layout to allocate"
                    + (f" ({'; '.join(notes)})" if notes else ""), pytrace=False)
    return found


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


def test_allocate_shapes_dtypes_device(allocator, layers, device):
    check_allocation(allocator, layers, device)


def test_allocate_rejects_mismatched_lengths(allocator, layers):
    shapes = [tuple(layer.kv_cache_shape(2)) for layer in layers]
    with pytest.raises(ValueError):
        allocator.allocate(shapes, [layers[0].kv_cache_torch_dtype()] * (len(shapes) + 1))


def test_blocks_round_trip_through_host_memory(allocator, layers, device):
    check_round_trip(allocator, layers, device)


def test_budget_to_allocation(allocator, platform, layers):
    check_budget_to_allocation(allocator, platform, layers)
