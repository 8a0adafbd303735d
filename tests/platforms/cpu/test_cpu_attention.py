"""CpuPagedAttentionBackend against the float64 torch reference of the conformance kit,
plus checks of its own KV layout (exact slots written) and declared capabilities."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil

import pytest
import torch

from portaserve.framework.interfaces import AttentionBatch, AttentionSpec
from portaserve.framework.plugins import get_registry
from portaserve.framework.testing.attention_checks import default_cases, reference_attention, relative_error, run_case
from portaserve.framework.testing.attention_checks import AttentionCase
from portaserve.platforms.cpu import native
from portaserve.platforms.cpu.attention import CpuPagedAttentionBackend

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CASES = [case for dtype in DTYPES for case in default_cases(CpuPagedAttentionBackend, dtype)]


@pytest.mark.grid(keep=3)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_against_reference(case):
    result = run_case(CpuPagedAttentionBackend, case, "cpu")
    assert result.skipped is None, result.skipped
    assert result.errors


class _SmallDecodeGroups(CpuPagedAttentionBackend):
    """Same backend, cut into many decode groups (each group has its own padding and mask)."""

    decode_group_tokens = 40


SMALL_GROUP_CASES = [c for c in default_cases(CpuPagedAttentionBackend, torch.float32) if "d128" not in c.name]


@pytest.mark.grid(keep=2)
@pytest.mark.parametrize("case", SMALL_GROUP_CASES, ids=[c.name for c in SMALL_GROUP_CASES])
def test_many_decode_groups(case):
    result = run_case(_SmallDecodeGroups, case, "cpu")
    assert result.skipped is None, result.skipped


class _StridedInputs(CpuPagedAttentionBackend):
    """Same backend fed q/k/v as views of one fused qkv tensor, as a fused projection yields them."""

    def _forward(self, q, k, v, kv_cache, metadata):
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=1)
        q, k, v = q.view(-1, h, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        assert not q.is_contiguous()
        return super()._forward(q, k, v, kv_cache, metadata)


STRIDED_CASES = [c for c in default_cases(CpuPagedAttentionBackend, torch.bfloat16) if "d128" not in c.name and "h4kv1" not in c.name]


@pytest.mark.grid(keep=2)
@pytest.mark.parametrize("case", STRIDED_CASES, ids=[c.name for c in STRIDED_CASES])
def test_strided_inputs(case):
    assert run_case(_StridedInputs, case, "cpu").skipped is None


def test_registered_under_its_name():
    assert get_registry().get("attention_backends", "cpu_paged") is CpuPagedAttentionBackend


def _spec(**kw):
    base = dict(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, dtype=torch.float32)
    base.update(kw)
    return AttentionSpec(**base)


def test_declared_capabilities():
    assert CpuPagedAttentionBackend.unsupported_reason(_spec(), 16) is None
    assert CpuPagedAttentionBackend.unsupported_reason(_spec(head_size=80), 128) is None
    assert "block size" in CpuPagedAttentionBackend.unsupported_reason(_spec(), 24)
    assert CpuPagedAttentionBackend.unsupported_reason(_spec(kv_cache_dtype="fp8"), 16) is not None
    with pytest.raises(ValueError, match="block size 24"):
        CpuPagedAttentionBackend(_spec(), 24, torch.device("cpu"))
    # encoders keep no cache, so any block size is fine
    assert CpuPagedAttentionBackend.unsupported_reason(_spec(causal=False), 24) is None


def test_exact_slots_written_and_metadata_frozen():
    """New K/V land in exactly their (block, offset) slots of the declared layout; nothing else changes."""
    bs, hkv, d = 16, 2, 64
    backend = CpuPagedAttentionBackend(_spec(), bs, torch.device("cpu"))
    num_blocks = 6
    shape = backend.kv_cache_shape(num_blocks)
    assert shape == (num_blocks, 2, hkv, bs, d)
    cache = torch.full(shape, float("nan"))
    gen = torch.Generator().manual_seed(0)
    # seq 0: 20 new tokens in blocks [4, 1]; seq 1: 3 new tokens in block [2]
    tables = [[4, 1], [2]]
    slot_mapping = torch.tensor([4 * bs + i for i in range(16)] + [1 * bs + i for i in range(4)] + [2 * bs + i for i in range(3)])
    n = slot_mapping.numel()
    q = torch.randn(n, 8, d, generator=gen)
    k = torch.randn(n, hkv, d, generator=gen)
    v = torch.randn(n, hkv, d, generator=gen)
    batch = AttentionBatch(
        query_start_loc=torch.tensor([0, 20, 23], dtype=torch.int32),
        seq_lens=torch.tensor([20, 3], dtype=torch.int32),
        block_table=torch.tensor([tables[0], tables[1] + [0]], dtype=torch.int32),
        slot_mapping=slot_mapping,
        max_query_len=20,
        max_seq_len=20,
        block_size=bs,
        num_actual_tokens=n,
    )
    md = backend.build_metadata(batch)
    assert dataclasses.is_dataclass(md)
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.num_actual_tokens = 0  # type: ignore[misc]
    out = backend.forward(q, k, v, cache, md)
    expected = torch.full(shape, float("nan"))
    for t, slot in enumerate(slot_mapping.tolist()):
        expected[slot // bs, 0, :, slot % bs] = k[t]
        expected[slot // bs, 1, :, slot % bs] = v[t]
    assert torch.equal(torch.isnan(cache), torch.isnan(expected))
    assert torch.equal(cache.nan_to_num(), expected.nan_to_num())
    ref = reference_attention(q, [k[:20], k[20:]], [v[:20], v[20:]], [20, 3], backend.spec)
    assert relative_error(out, ref) < 1e-5


def test_large_decode_batch_bf16():
    """The serving shape of the benchmark (64 decodes, contexts 100-300, 14 heads / 2 KV heads)."""
    bs, h, hkv, d = 16, 14, 2, 64
    spec = AttentionSpec(h, hkv, d, 1 / math.sqrt(d), torch.bfloat16)
    backend = CpuPagedAttentionBackend(spec, bs, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(100, 301, (64,), generator=gen)
    nb = [-(-int(n) // bs) for n in lens]
    perm = torch.randperm(sum(nb), generator=gen)
    tables, start = [], 0
    for b in nb:
        tables.append(perm[start : start + b])
        start += b
    cache = torch.full(backend.kv_cache_shape(sum(nb)), float("nan"), dtype=torch.bfloat16)
    keys = [torch.randn(int(n), hkv, d, generator=gen).bfloat16() for n in lens]
    values = [torch.randn(int(n), hkv, d, generator=gen).bfloat16() for n in lens]
    # write each context except its last token straight into the declared layout
    for table, key, value in zip(tables, keys, values):
        for pos in range(key.shape[0] - 1):
            cache[table[pos // bs], 0, :, pos % bs] = key[pos]
            cache[table[pos // bs], 1, :, pos % bs] = value[pos]
    block_table = torch.zeros(64, max(nb), dtype=torch.int32)
    for i, table in enumerate(tables):
        block_table[i, : len(table)] = table
    last = lens - 1
    slot_mapping = torch.stack([tables[i][last[i] // bs] * bs + last[i] % bs for i in range(64)])
    batch = AttentionBatch(
        query_start_loc=torch.arange(65, dtype=torch.int32),
        seq_lens=lens.to(torch.int32),
        block_table=block_table,
        slot_mapping=slot_mapping,
        max_query_len=1,
        max_seq_len=int(lens.max()),
        block_size=bs,
        num_actual_tokens=64,
    )
    q = torch.randn(64, h, d, generator=gen).bfloat16()
    k = torch.stack([key[-1] for key in keys])
    v = torch.stack([value[-1] for value in values])
    out = backend.forward(q, k, v, cache, backend.build_metadata(batch))
    ref = reference_attention(q, keys, values, [1] * 64, spec)
    assert relative_error(out, ref) < 1e-2


# ----- the C decode kernel (platforms/cpu/paged_decode.c) and the torch path it replaces -----


class _TorchDecodes(CpuPagedAttentionBackend):
    """The backend with its C decode kernel switched off: decodes through SDPA."""

    def __init__(self, spec, block_size, device):
        super().__init__(spec, block_size, device)
        self._native = None


class _SplitContexts(CpuPagedAttentionBackend):
    """The C kernel with 24-key context parts: most decodes span several parts, merged
    with flash-decoding's rescale, and parts start in the middle of blocks."""

    native_part_len = 24


def _native_required() -> bool:
    return any(shutil.which(c) for c in ("cc", "gcc", "clang")) and os.environ.get("PORTASERVE_CPU_NATIVE") != "0"


def test_native_kernel_builds_where_there_is_a_compiler():
    kernels = native.load()
    if _native_required():
        assert kernels is not None, native.unavailable_reason()
        backend = CpuPagedAttentionBackend(_spec(dtype=torch.bfloat16), 16, torch.device("cpu"))
        assert backend._native is kernels
    else:
        assert kernels is None and native.unavailable_reason()


@pytest.mark.grid(keep=3)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_torch_decode_path_against_reference(case):
    result = run_case(_TorchDecodes, case, "cpu")
    assert result.skipped is None, result.skipped


def _decode_heavy_cases():
    """Long contexts (several parts of 24 keys), then decodes; the head sizes of both the
    kernel's bf16 fast path (64, 128, 256) and its generic path (80, 72), GQA ratios 1, 7, 8
    and 32 (MQA), block sizes from 8 to 128, windows and a soft cap."""
    steps = ((70, 45, 1, 130), (1, 1, 1, 1), (1, 1, 1, 1))
    for dtype in DTYPES:
        d = str(dtype).removeprefix("torch.")
        for hs in (64, 80, 128, 256, 72):
            for h, hkv in ((4, 4), (14, 2), (16, 2), (32, 1)):
                yield AttentionCase(f"native-{d}-d{hs}-h{h}kv{hkv}", h, hkv, hs, 16, dtype, steps, seed=hs + h)
        for bs in (8, 32, 128):
            yield AttentionCase(f"native-{d}-bs{bs}", 8, 2, 64, bs, dtype, steps, seed=bs)
        yield AttentionCase(f"native-{d}-window", 8, 2, 64, 16, dtype, steps, sliding_window=50, seed=21)
        yield AttentionCase(f"native-{d}-softcap", 8, 2, 128, 16, dtype, steps, logits_soft_cap=3.0, seed=22)


NATIVE_CASES = list(_decode_heavy_cases())


@pytest.mark.grid(keep=3)
@pytest.mark.parametrize("case", NATIVE_CASES, ids=[c.name for c in NATIVE_CASES])
def test_native_split_contexts_against_reference(case):
    result = run_case(_SplitContexts, case, "cpu")
    assert result.skipped is None, result.skipped


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 4e-3), (torch.float32, 2e-6)])
def test_native_decode_error_is_rounding_only(dtype, tol):
    """Tighter than the kit's tolerance: the kernel's only error is the cache dtype's
    rounding (of the output, and of p for bf16's p.v), on the benchmark's shape."""
    if native.load() is None:
        pytest.skip(f"no C kernel: {native.unavailable_reason()}")
    from portaserve.platforms.cpu.bench_attention import make_batch

    spec = AttentionSpec(14, 2, 64, 0.125, dtype)
    backend = _SplitContexts(spec, 16, torch.device("cpu"))
    lens = torch.randint(20, 300, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    batch, cache, q, k, v = make_batch(backend, [1] * len(lens), lens)
    out = backend.forward(q, k, v, cache, backend.build_metadata(batch))
    keys, values = [], []  # every context position is in the cache now (the new token's too)
    for i, n in enumerate(lens):
        blocks = batch.block_table[i, : -(-n // 16)].tolist()
        kv = cache[blocks]  # [blocks, 2, hkv, bs, d]
        keys.append(kv[:, 0].transpose(1, 2).reshape(-1, 2, 64)[:n])
        values.append(kv[:, 1].transpose(1, 2).reshape(-1, 2, 64)[:n])
    ref = reference_attention(q, keys, values, [1] * len(lens), spec)
    assert relative_error(out, ref) < tol
