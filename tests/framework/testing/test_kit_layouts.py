"""The conformance kit checks any KV layout a backend declares, never assuming block-major.

Issue 22, failure 2: a backend with vLLM's ``[2, num_blocks, block_size, kv_heads,
head_size]`` layout generated correctly, yet the kit failed it with IndexErrors inside
the kit. Here a backend with that layout (tests/framework/testing/vllm_layout_plugin.py, plain
torch, ``kv_cache_block_dim = 1``) passes the attention grid the kit builds for its
platform and the KV-cache allocator checks, and planted bugs in such a backend and
allocator are caught with messages about them, not about the kit. The same plugin,
installed as a distribution, passes the whole kit in tests/framework/testing/test_conformance.py.
"""

from __future__ import annotations

import pytest
import torch
from vllm_layout_plugin import VllmLayoutAttentionBackend, VllmLayoutKVCacheAllocator, VllmLayoutPlatform

from portaserve.framework.interfaces import AttentionBatch, AttentionSpec, PlatformCapabilities
from portaserve.framework.testing.attention_grid import platform_cases
from portaserve.framework.testing.attention_checks import run_case
from portaserve.framework.testing.kv_cache_checks import (
    check_allocation,
    check_budget_to_allocation,
    check_round_trip,
)

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny tensors: intra-op threads only add contention (10x slower on a loaded machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def platform():
    return VllmLayoutPlatform(VllmLayoutPlatform.probe())


def _cases(platform, backend=VllmLayoutAttentionBackend, dtype=torch.float32):
    return [c for c in platform_cases(backend, platform.capabilities()) if c.dtype == dtype]


def _layers(backend=VllmLayoutAttentionBackend):
    return [backend(AttentionSpec(4, 2, 64, 0.125, torch.bfloat16), 32, CPU),
            backend(AttentionSpec(2, 1, 128, 0.09, torch.float32), 32, CPU)]


def test_the_grid_uses_the_platform_declarations(platform):
    cases = platform_cases(VllmLayoutAttentionBackend, platform.capabilities())
    assert {c.block_size for c in cases} == {16, 32}
    # the platform's default block size carries the full scenario set
    assert {c.block_size for c in cases if c.name.startswith("padding")} == {32}
    assert {c.head_size for c in cases} >= {64, 80, 128, 256}  # any head size: the representative set
    assert {c.dtype for c in cases} == {torch.float32, torch.bfloat16, torch.float16}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_layout_passes_the_attention_checks(platform, dtype):
    cases = _cases(platform, dtype=dtype)
    assert len(cases) > 15
    results = [run_case(VllmLayoutAttentionBackend, case, CPU) for case in cases]
    ran = [r for r in results if not r.skipped]
    assert len(ran) == len(cases), [r.skipped for r in results if r.skipped]


def test_vllm_layout_passes_the_kv_cache_checks(platform):
    layers = _layers()
    allocator = VllmLayoutKVCacheAllocator(CPU)
    check_allocation(allocator, layers, CPU)
    check_round_trip(allocator, layers, CPU)
    check_budget_to_allocation(allocator, platform, layers)


class Fp8Cache(VllmLayoutAttentionBackend):
    """The same layout with an fp8 KV cache: K/V rounded to e4m3 on write (unscaled)."""

    supported_kv_cache_dtypes = frozenset({"auto", "fp8"})
    kv_scale = 1.0

    def write(self, kv_cache, k, v, slots) -> None:
        # index_copy_ has no fp8 kernel on the CPU: copy the bytes
        for plane, x in ((0, k), (1, v)):
            fp8 = (x.float() / self.kv_scale).to(kv_cache.dtype)
            kv_cache[plane].view(torch.uint8).flatten(0, 1).index_copy_(0, slots, fp8.view(torch.uint8))


class Fp8CacheForgetsItsScale(Fp8Cache):
    kv_scale = 4.0  # stores K / 4 and V / 4, reads them back as K and V


FP8_CAPS = PlatformCapabilities(dtypes=frozenset({torch.bfloat16, torch.float32}), kv_cache_dtypes=frozenset({"auto", "fp8"}),
                                block_sizes=frozenset({16, 32}), default_block_size=32)


def test_fp8_kv_caches_are_checked_against_a_rounded_reference():
    cases = [c for c in platform_cases(Fp8Cache, FP8_CAPS) if c.kv_cache_dtype == "fp8"]
    assert {c.dtype for c in cases} == {torch.bfloat16, torch.float32} and len(cases) == 6
    for case in cases:
        result = run_case(Fp8Cache, case, CPU)
        assert not result.skipped and max(result.errors) < 1e-2, (case.name, result)
    with pytest.raises(AssertionError, match="relative error"):
        run_case(Fp8CacheForgetsItsScale, cases[0], CPU)


# ----- planted bugs ----------------------------------------------------------------------


class DeclaresBlockMajor(VllmLayoutAttentionBackend):
    """The [2, blocks, ...] layout declared as block-major (kv_cache_block_dim left at 0)."""

    kv_cache_block_dim = 0


class WritesPadding(VllmLayoutAttentionBackend):
    """Writes the K/V of padding tokens too (their slots belong to live tokens)."""

    def slots_to_write(self, batch: AttentionBatch) -> torch.Tensor:
        return batch.slot_mapping.to(torch.int64)


class SwapsPlanesOnWrite(VllmLayoutAttentionBackend):
    """Writes K into the V plane and V into the K plane (reads them the right way)."""

    def write(self, kv_cache, k, v, slots) -> None:
        super().write(kv_cache, v, k, slots)


class MovesDimZero(VllmLayoutKVCacheAllocator):
    """Ignores the block dims it is given and moves blocks along dim 0."""

    def _copy_blocks_along(self, caches, block_ids, device, block_dims):
        index = torch.as_tensor(list(block_ids), dtype=torch.long)
        return [cache.index_select(0, index).to(device) for cache in caches]


def _case(platform, prefix: str):
    return next(c for c in _cases(platform) if c.name.startswith(prefix))


def test_a_wrong_block_dim_declaration_is_reported_as_such(platform):
    for case in (_case(platform, "mixed"), _case(platform, "decodes")):
        with pytest.raises(AssertionError, match="kv_cache_block_dim is 0"):
            run_case(DeclaresBlockMajor, case, CPU)
    with pytest.raises(AssertionError, match="kv_cache_block_dim is 0"):
        check_allocation(VllmLayoutKVCacheAllocator(CPU), _layers(DeclaresBlockMajor), CPU)


def test_writing_padding_tokens_is_caught(platform):
    case = _case(platform, "padding")
    run_case(VllmLayoutAttentionBackend, case, CPU)  # the correct backend passes it
    with pytest.raises(AssertionError, match="relative error|written values"):
        run_case(WritesPadding, case, CPU)


def test_swapped_k_and_v_planes_are_caught(platform):
    with pytest.raises(AssertionError, match="relative error"):
        run_case(SwapsPlanesOnWrite, _case(platform, "mixed"), CPU)


def test_an_allocator_moving_the_wrong_dimension_is_caught():
    with pytest.raises(AssertionError, match="block_dims=\\[1, 1\\]"):
        check_round_trip(MovesDimZero(CPU), _layers(), CPU)
