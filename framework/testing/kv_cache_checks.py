"""KV-cache allocator checks over the layouts the platform's attention backends declare.

The allocator allocates what the backends ask for (`kv_cache_shape`, the KV dtype) and
moves blocks along the dimension each backend declares (`kv_cache_block_dim`), so the
checks build their layers from the backends, never from an assumed block-major shape:
`representative_layers` instantiates each backend declaring the platform on a spec it
supports, at the platform's default block size, and the `check_*` functions exercise
an allocator on those layers (raising AssertionError on a mismatch). Plugin tests can
call them on a backend and allocator of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from portaserve.framework.interfaces import AttentionBackend, AttentionSpec, KVCacheAllocator
from portaserve.framework.testing.attention_grid import tested_block_sizes, tested_dtypes, tested_head_sizes, tested_kv_dtypes
from portaserve.framework.testing.kv_layout import check_kv_layout, is_fp8

#: (num_heads, num_kv_heads) tried in order for a representative spec
_HEAD_CONFIGS = ((4, 2), (4, 4), (2, 1), (8, 1))


def representative_spec(backend_cls: type[AttentionBackend], dtype: torch.dtype, block_size: int,
                        head_sizes: Sequence[int], kv_cache_dtype: str = "auto") -> AttentionSpec | None:
    """The first spec (head size, then head configuration, in order) the backend supports."""
    for head_size in head_sizes:
        for num_heads, num_kv_heads in _HEAD_CONFIGS:
            spec = AttentionSpec(num_heads, num_kv_heads, head_size, head_size**-0.5, dtype, kv_cache_dtype=kv_cache_dtype)
            if backend_cls.unsupported_reason(spec, block_size) is None:
                return spec
    return None


def representative_layers(registry, platform, device: torch.device) -> tuple[list[AttentionBackend], list[str]]:
    """Backend instances standing for a model's layers, and why some backends have none.

    Per backend declaring the platform (with the features it needs): two layers at the
    platform's default block size (else the first common one), in the first and last
    common dtype with different head sizes where the backend allows, plus one layer per
    KV dtype besides "auto" that both declare.
    """
    caps = platform.capabilities()
    layers: list[AttentionBackend] = []
    notes: list[str] = []
    for name, cls in sorted(registry.load_all("attention_backends").items()):
        if not cls.runs_on(platform.name):
            continue
        missing = set(cls.required_features) - set(caps.features)
        dtypes, block_sizes = tested_dtypes(cls, caps), tested_block_sizes(cls, caps)
        if missing or not dtypes or not block_sizes:
            notes.append(f"{name}: " + (f"needs features {sorted(missing)}" if missing else "no common dtype or block size"))
            continue
        block_size, head_sizes = block_sizes[0], tested_head_sizes(cls)
        wanted = [(dtypes[0], head_sizes, "auto"), (dtypes[-1], head_sizes[1:] + head_sizes[:1], "auto")]
        wanted += [(dtypes[0], head_sizes, kv) for kv in tested_kv_dtypes(cls, caps)]
        for dtype, sizes, kv in wanted:
            spec = representative_spec(cls, dtype, block_size, sizes, kv)
            if spec is None:
                notes.append(f"{name}: no supported spec in {dtype} with KV dtype {kv}")
                continue
            layers.append(cls(spec, block_size, device))
    return layers, notes


def _bits(t: torch.Tensor) -> torch.Tensor:
    # fp8 tensors lack some comparison ops on some devices; their bytes compare exactly.
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a.cpu()), _bits(b.cpu()))


def _random_like(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def check_allocation(allocator: KVCacheAllocator, layers: Sequence[AttentionBackend], device: torch.device,
                     num_blocks: int = 6) -> None:
    """Shapes, dtypes, device and contiguity as asked; layers do not share storage."""
    shapes = [tuple(layer.kv_cache_shape(num_blocks)) for layer in layers]
    dtypes = [layer.kv_cache_torch_dtype() for layer in layers]
    for layer in layers:
        check_kv_layout(layer, num_blocks)
    caches = allocator.allocate(shapes, dtypes)
    assert len(caches) == len(layers), f"allocate returned {len(caches)} tensors for {len(layers)} layers"
    for cache, shape, dtype in zip(caches, shapes, dtypes):
        assert tuple(cache.shape) == shape and cache.dtype == dtype, (
            f"allocated {tuple(cache.shape)} {cache.dtype}, asked for {shape} {dtype}")
        assert cache.device.type == torch.device(device).type, f"allocated on {cache.device}, expected {device}"
        assert cache.is_contiguous(), f"the {shape} cache is not contiguous"
    for i, cache in enumerate(caches):
        _bits(cache).fill_(i + 1)
    for i, cache in enumerate(caches):
        assert bool((_bits(cache) == i + 1).all()), f"layer {i} shares storage with a later layer"
    allocator.release(caches)
    assert caches == [], "release() must empty the list"


def check_round_trip(allocator: KVCacheAllocator, layers: Sequence[AttentionBackend], device: torch.device,
                     num_blocks: int = 8, block_ids: Sequence[int] = (5, 0, 3)) -> None:
    """Blocks copied to host memory and back along each layer's declared block dimension."""
    dims = [layer.kv_cache_block_dim for layer in layers]
    caches = allocator.allocate([tuple(layer.kv_cache_shape(num_blocks)) for layer in layers],
                                [layer.kv_cache_torch_dtype() for layer in layers])
    gen = torch.Generator().manual_seed(0)
    originals = []
    for cache in caches:
        values = _random_like(cache.shape, cache.dtype, gen)
        cache.copy_(values.to(cache.device))
        originals.append(values)
    index = torch.tensor(list(block_ids))
    try:
        host = allocator.copy_blocks_to_host(caches, list(block_ids), dims)
    except Exception as exc:  # an allocator bug, not the kit's: say whose call failed
        raise AssertionError(f"copy_blocks_to_host(block_ids={list(block_ids)}, block_dims={dims}) on caches "
                             f"{[tuple(c.shape) for c in caches]} raised {type(exc).__name__}: {exc}") from exc
    assert len(host) == len(caches), f"copy_blocks_to_host returned {len(host)} tensors for {len(caches)} layers"
    for i, (saved, values, dim) in enumerate(zip(host, originals, dims)):
        assert saved.device.type == "cpu", f"layer {i}: host copy is on {saved.device}"
        assert _same(saved, values.index_select(dim, index)), (
            f"layer {i}: host copy differs from blocks {list(block_ids)} along dim {dim} "
            f"(got shape {tuple(saved.shape)}); the allocator must move blocks along the given block_dims")
    for cache in caches:
        _bits(cache).zero_()
    try:
        allocator.copy_blocks_from_host(caches, host, list(block_ids), dims)
    except Exception as exc:
        raise AssertionError(f"copy_blocks_from_host(block_ids={list(block_ids)}, block_dims={dims}) raised "
                             f"{type(exc).__name__}: {exc}") from exc
    others = torch.tensor(sorted(set(range(num_blocks)) - set(block_ids)))
    for i, (cache, values, dim) in enumerate(zip(caches, originals, dims)):
        back = cache.to("cpu")
        assert _same(back.index_select(dim, index), values.index_select(dim, index)), f"layer {i}: blocks not restored"
        assert not bool(_bits(back.index_select(dim, others)).any()), f"layer {i}: blocks outside block_ids were written"
    allocator.release(caches)


def check_budget_to_allocation(allocator: KVCacheAllocator, platform, layers: Sequence[AttentionBackend],
                               budget_gib: float = 1 / 128) -> None:
    """The engine's path: budget -> bytes per block (all layers) -> number of blocks -> tensors."""
    budget = platform.kv_cache_budget_bytes(budget_gib)
    per_block = sum(layer.kv_cache_bytes_per_block() for layer in layers)
    n = allocator.num_blocks(budget, per_block)
    assert n > 0, f"no block of {per_block} B fits {budget} B"
    caches = allocator.allocate([tuple(layer.kv_cache_shape(n)) for layer in layers],
                                [layer.kv_cache_torch_dtype() for layer in layers])
    used = sum(c.numel() * c.element_size() for c in caches)
    for cache, layer in zip(caches, layers):
        assert cache.shape[layer.kv_cache_block_dim] == n
    assert used <= budget, f"{n} blocks take {used} B, over the budget of {budget} B"
    allocator.release(caches)
