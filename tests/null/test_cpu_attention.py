"""CpuPagedAttentionBackend against the float64 torch reference of the conformance kit,
plus checks of its own KV layout (exact slots written) and declared capabilities."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from portaserve.framework.interfaces import AttentionBatch, AttentionSpec
from portaserve.framework.plugins import get_registry
from portaserve.framework.testing.attention_checks import default_cases, reference_attention, relative_error, run_case
from portaserve.platforms.cpu.attention import CpuPagedAttentionBackend

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CASES = [case for dtype in DTYPES for case in default_cases(CpuPagedAttentionBackend, dtype)]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_against_reference(case):
    result = run_case(CpuPagedAttentionBackend, case, "cpu")
    assert result.skipped is None, result.skipped
    assert result.errors


class _SmallDecodeGroups(CpuPagedAttentionBackend):
    """Same backend, cut into many decode groups (each group has its own padding and mask)."""

    decode_group_tokens = 40


SMALL_GROUP_CASES = [c for c in default_cases(CpuPagedAttentionBackend, torch.float32) if "d128" not in c.name]


@pytest.mark.parametrize("case", SMALL_GROUP_CASES, ids=[c.name for c in SMALL_GROUP_CASES])
def test_many_decode_groups(case):
    result = run_case(_SmallDecodeGroups, case, "cpu")
    assert result.skipped is None, result.skipped


class _StridedInputs(CpuPagedAttentionBackend):
    """Same backend fed q/k/v as views of one fused qkv tensor, as a fused projection yields them."""

    def forward(self, q, k, v, kv_cache, metadata):
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=1)
        q, k, v = q.view(-1, h, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        assert not q.is_contiguous()
        return super().forward(q, k, v, kv_cache, metadata)


STRIDED_CASES = [c for c in default_cases(CpuPagedAttentionBackend, torch.bfloat16) if "d128" not in c.name and "h4kv1" not in c.name]


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
