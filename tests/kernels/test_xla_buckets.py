"""The TPU path without a TPU: the pure-Python shape buckets, and the static-shape
attention math of XlaPagedAttentionBackend on CPU tensors (no torch_xla) against the
conformance kit's float64 reference."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from portaserve.framework.interfaces import AttentionBatch, AttentionSpec
from portaserve.framework.testing.attention_checks import default_cases, reference_attention, relative_error, run_case
from portaserve.kernels.xla_attention import XlaPagedAttentionBackend, dense_paged_attention
from portaserve.kernels.xla_buckets import Buckets, StepBuckets, StepShape, pad_list

# ----- buckets -----------------------------------------------------------------------------


def test_pad_picks_smallest_bucket_at_least_n():
    b = Buckets("tokens", (16, 32, 64, 100))
    assert [b.pad(n) for n in (0, 1, 16, 17, 32, 33, 64, 65, 100)] == [16, 16, 16, 32, 32, 64, 64, 100, 100]
    with pytest.raises(ValueError, match="tokens: 101 exceeds the largest bucket 100"):
        b.pad(101)
    with pytest.raises(ValueError, match=">= 0"):
        b.pad(-1)


def test_buckets_validate():
    with pytest.raises(ValueError, match="at least one"):
        Buckets("seqs", ())
    with pytest.raises(ValueError, match="strictly ascending"):
        Buckets("seqs", (8, 8, 16))
    with pytest.raises(ValueError, match="strictly ascending"):
        Buckets("seqs", (0, 8))
    with pytest.raises(ValueError, match="minimum <= maximum"):
        Buckets.geometric("seqs", 16, 8)
    with pytest.raises(ValueError, match="linear_step"):
        Buckets.geometric("seqs", 1, 8, linear_step=0)


def test_geometric_buckets():
    assert Buckets.geometric("s", 8, 256).sizes == (8, 16, 32, 64, 128, 256)
    assert Buckets.geometric("s", 8, 100).sizes == (8, 16, 32, 64, 100)  # the maximum is always a bucket
    assert Buckets.geometric("s", 5, 5).sizes == (5,)
    assert Buckets.geometric("t", 16, 2048, linear_step=512).sizes == (16, 32, 64, 128, 256, 512, 1024, 1536, 2048)
    assert Buckets.geometric("t", 16, 1300, linear_step=512).sizes == (16, 32, 64, 128, 256, 512, 1024, 1300)
    # a minimum that is not a power of two doubles, then snaps to the linear grid
    assert Buckets.geometric("t", 3, 2000, linear_step=500).sizes == (3, 6, 12, 24, 48, 96, 192, 384, 768, 1000, 1500, 2000)


@pytest.mark.parametrize("linear_step", (None, 64))
def test_geometric_waste_is_bounded(linear_step):
    b = Buckets.geometric("t", 4, 1000, linear_step=linear_step)
    for n in range(1001):
        padded = b.pad(n)
        assert padded >= n and padded in b.sizes
        if n >= 4:
            assert padded < 2 * n or (linear_step and padded - n < linear_step)


def test_step_buckets_for_limits():
    sb = StepBuckets.for_limits(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=4096, block_size=16)
    assert sb.tokens.sizes == (16, 32, 64, 128, 256, 512, 1024, 1536, 2048)
    assert sb.seqs.sizes == (8, 16, 32, 64)
    assert sb.query_lens.sizes[0] == 1 and sb.query_lens.maximum == 2048
    assert sb.blocks.maximum == 256  # 4096 tokens / 16 per block
    assert sb.step_shape(num_tokens=37, num_seqs=5, max_query_len=30, blocks_per_seq=9) == StepShape(64, 8, 32, 16)
    # a decode-only step keeps one query row per sequence
    assert sb.step_shape(num_tokens=20, num_seqs=20, max_query_len=1, blocks_per_seq=200).max_query_len == 1
    assert sb.num_graphs() == len(sb.tokens.sizes) * 4 * len(sb.query_lens.sizes) * len(sb.blocks.sizes)
    with pytest.raises(ValueError, match="seqs: 65 exceeds"):
        sb.step_shape(num_tokens=65, num_seqs=65, max_query_len=1, blocks_per_seq=1)
    with pytest.raises(ValueError, match="max_query_len 9 exceeds num_tokens 8"):
        sb.step_shape(num_tokens=8, num_seqs=1, max_query_len=9, blocks_per_seq=1)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        StepBuckets.for_limits(max_num_batched_tokens=8, max_num_seqs=0, max_model_len=8, block_size=16)
    # limits smaller than the default minima still give valid buckets
    tiny = StepBuckets.for_limits(max_num_batched_tokens=4, max_num_seqs=2, max_model_len=10, block_size=16)
    assert tiny.tokens.sizes == (4,) and tiny.seqs.sizes == (2,) and tiny.blocks.sizes == (1,)


def test_pad_list():
    assert pad_list([3, 1], 4, 0) == [3, 1, 0, 0]
    assert pad_list([], 2, 7) == [7, 7]
    with pytest.raises(ValueError, match="do not fit"):
        pad_list([1, 2, 3], 2, 0)


# ----- the static-shape attention math on CPU ------------------------------------------------


def _batch(seqs, block_size, gen, num_padding_tokens=0):
    """Host AttentionBatch for [(cached_prefix, query_len)], shuffled blocks, and its tables."""
    seq_lens = [c + q for c, q in seqs]
    pages = [-(-n // block_size) for n in seq_lens]
    pool = torch.randperm(sum(pages) + 2, generator=gen).tolist()
    tables = [[pool.pop() for _ in range(p)] for p in pages]
    block_table = torch.zeros(len(seqs), max(pages), dtype=torch.int32)
    slots = []
    for i, (c, q) in enumerate(seqs):
        block_table[i, : pages[i]] = torch.tensor(tables[i], dtype=torch.int32)
        slots += [tables[i][p // block_size] * block_size + p % block_size for p in range(c, c + q)]
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for _c, q in seqs]), 0)
    batch = AttentionBatch(
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots + [slots[0]] * num_padding_tokens, dtype=torch.int64),
        max_query_len=max(q for _c, q in seqs),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        num_actual_tokens=len(slots),
    )
    return batch, tables, sum(pages) + 2


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("float32", "bfloat16"))
@pytest.mark.parametrize(("gqa", "window", "soft_cap"), [(1, None, None), (4, None, None), (8, 7, None), (4, None, 2.0)])
def test_dense_paged_attention_matches_reference(gqa, window, soft_cap, dtype):
    gen = torch.Generator().manual_seed(gqa)
    bs, hkv, d = 16, 2, 64
    seqs = [(0, 19), (37, 1), (bs + 5, 22), (3 * bs - 1, 1)]
    batch, tables, num_blocks = _batch(seqs, bs, gen)
    spec = AttentionSpec(hkv * gqa, hkv, d, 1.3 / math.sqrt(d), dtype, sliding_window=window, logits_soft_cap=soft_cap)
    backend = XlaPagedAttentionBackend(spec, bs, torch.device("cpu"))
    cache = torch.full(backend.kv_cache_shape(num_blocks), float("nan"), dtype=dtype)
    keys = [torch.randn(c + q, hkv, d, generator=gen).to(dtype) for c, q in seqs]
    values = [torch.randn(c + q, hkv, d, generator=gen).to(dtype) for c, q in seqs]
    for i, (c, _q) in enumerate(seqs):  # the cached prefixes
        for p in range(c):
            cache[tables[i][p // bs], p % bs, 0] = keys[i][p]
            cache[tables[i][p // bs], p % bs, 1] = values[i][p]
    q = torch.randn(batch.num_actual_tokens, spec.num_heads, d, generator=gen).to(dtype)
    k_new = torch.cat([keys[i][c:] for i, (c, _q) in enumerate(seqs)])
    v_new = torch.cat([values[i][c:] for i, (c, _q) in enumerate(seqs)])
    meta = backend.build_metadata(batch)
    out = backend.forward(q, k_new, v_new, cache, meta)
    ref = reference_attention(q, keys, values, [s[1] for s in seqs], spec)
    tol = 1e-5 if dtype is torch.float32 else 1e-2
    assert relative_error(out, ref) <= tol
    # exactly the new tokens' slots were written
    written = int((~torch.isnan(cache.float())).sum())
    assert written == sum(c + q for c, q in seqs) * 2 * hkv * d


def test_step_shapes_are_buckets_and_padding_stays_out():
    gen = torch.Generator().manual_seed(0)
    spec = AttentionSpec(8, 2, 64, 0.125, torch.float32)
    backend = XlaPagedAttentionBackend(spec, 16, torch.device("cpu"))
    shapes = set()
    for seqs in ([(0, 5), (36, 1), (3, 9)], [(40, 1), (0, 13), (2, 2)], [(30, 3), (7, 1), (11, 12)]):
        batch, _tables, _n = _batch(seqs, 16, gen, num_padding_tokens=32 - sum(q for _c, q in seqs))
        meta = backend.build_metadata(batch)
        shapes.add((meta.block_table.shape, meta.seq_lens.shape, meta.dense_rows.shape, meta.query_pad))
        # padding tokens: scratch row, and they write token 0's slot with token 0's values
        real = batch.num_actual_tokens
        assert (meta.dense_rows[real:] == meta.block_table.shape[0] * meta.query_pad).all()
        assert (meta.write_src[real:] == 0).all() and meta.write_src[:real].tolist() == list(range(real))
    # three different batches, one compiled shape
    assert shapes == {(torch.Size([8, 4]), torch.Size([8]), torch.Size([32]), 16)}


def test_dense_math_is_plain_tensors():
    # one sequence, uniform keys: the output is the mean of the visible values
    cache = torch.zeros(1, 16, 2, 1, 4)
    cache[0, :3, 1, 0, 0] = torch.tensor([1.0, 2.0, 4.0])
    out = dense_paged_attention(
        torch.zeros(2, 1, 4),
        cache,
        torch.zeros(1, 1, dtype=torch.int64),
        torch.tensor([3]),
        torch.tensor([2]),
        torch.tensor([0, 1]),
        query_pad=2,
        scale=1.0,
    )
    assert out[:, 0, 0].tolist() == pytest.approx([1.5, 7 / 3])


KIT_CASES = [c for dtype in (torch.float32, torch.bfloat16) for c in default_cases(XlaPagedAttentionBackend, dtype)]


@pytest.mark.grid(keep=3)
@pytest.mark.parametrize("case", KIT_CASES, ids=[c.name for c in KIT_CASES])
def test_conformance_kit_on_cpu(case):
    result = run_case(XlaPagedAttentionBackend, case, "cpu")
    if case.name.startswith("encoder-"):
        assert result.skipped and "encoder" in result.skipped
        return
    assert result.skipped is None, result.skipped


@pytest.mark.slow
def test_declared_capabilities_and_no_torch_xla_import():
    cls = XlaPagedAttentionBackend
    assert cls.name == "xla_paged" and cls.platforms == {"tpu"} and cls.required_features == {"xla"}
    assert "dtype" in cls.unsupported_reason(AttentionSpec(8, 2, 64, 0.1, torch.float16), 16)
    assert cls.unsupported_reason(AttentionSpec(8, 2, 80, 0.1, torch.bfloat16, sliding_window=4), 128) is None
    code = (
        "import sys; sys.modules['torch_xla'] = None\n"
        "import portaserve.kernels.xla_attention, portaserve.kernels.xla_buckets\n"
        "assert 'triton' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
