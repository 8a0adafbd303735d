"""`--kv-cache-dtype fp8` in the Triton attention backend, on CPU through the Triton
interpreter: the cache holds e4m3 values of K / k_scale and V / v_scale, and attention
over it equals float64 attention over those values dequantized (and stays within fp8's
rounding of attention over the unquantized K/V)."""

from __future__ import annotations

import pytest
import torch

from portaserve.framework.interfaces import AttentionBatch, AttentionSpec
from portaserve.kernels._interpret import interpreter_env

with interpreter_env():
    pytest.importorskip("triton")
    from portaserve.kernels import paged_attention, reshape_and_cache  # noqa: F401
    from portaserve.kernels import triton_backend
    from portaserve.kernels.kv_layout import KEY, VALUE
    from portaserve.kernels.paged_attention import paged_attention_ref
    from portaserve.kernels.triton_backend import TritonAttentionBackend

BLOCK = 16


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_backend, "_new_output", lambda q: torch.full_like(q, float("nan")))


def _batch(seq_lens, query_lens, tables) -> AttentionBatch:
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    slots = []
    for s, n, t in zip(seq_lens, query_lens, tables):
        slots += [t[p // BLOCK] * BLOCK + p % BLOCK for p in range(s - n, s)]
    width = max(len(t) for t in tables)
    return AttentionBatch(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=BLOCK,
        num_actual_tokens=qsl[-1],
    )


def _attention_float(q, k_all, v_all, seq_lens, query_lens, scale):
    """float64 causal attention over unquantized context K/V, per sequence ([tokens, heads, d])."""
    out, start_q, start_kv = [], 0, 0
    for s, n in zip(seq_lens, query_lens):
        k = k_all[start_kv : start_kv + s].double().repeat_interleave(q.shape[1] // k_all.shape[1], 1)
        v = v_all[start_kv : start_kv + s].double().repeat_interleave(q.shape[1] // k_all.shape[1], 1)
        qs = q[start_q : start_q + n].double()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        visible = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]
        out.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v))
        start_q += n
        start_kv += s
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 0.02)])
def test_fp8_cache_prefill_then_decode(dtype, k_scale, v_scale):
    torch.manual_seed(0)
    heads, kv_heads, d = 4, 2, 32
    spec = AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_size=d, scale=d**-0.5, dtype=dtype, kv_cache_dtype="fp8")
    backend = TritonAttentionBackend(spec, BLOCK, torch.device("cpu"))
    backend.k_scale, backend.v_scale = k_scale, v_scale
    assert backend.kv_cache_torch_dtype() == torch.float8_e4m3fn
    cache = torch.zeros(backend.kv_cache_shape(8), dtype=backend.kv_cache_torch_dtype())
    # one byte per element: half a bf16 cache, a quarter of a float32 one
    assert backend.kv_cache_bytes_per_block() == 2 * kv_heads * BLOCK * d
    tables = [[3, 1], [6, 2, 5]]
    lens = [20, 37]
    # with the small scales the stored values reach ~200, inside e4m3's 448
    k_all = (torch.randn(sum(lens), kv_heads, d) * 2).to(dtype)
    v_all = torch.randn(sum(lens), kv_heads, d).to(dtype)
    starts = [0, lens[0]]

    def run(seq_lens, query_lens):
        batch = _batch(seq_lens, query_lens, tables)
        rows = torch.cat([torch.arange(st + s - n, st + s) for st, s, n in zip(starts, seq_lens, query_lens)])
        q = torch.randn(len(rows), heads, d).to(dtype)
        out = backend.forward(q, k_all[rows], v_all[rows], cache, backend.build_metadata(batch))
        return q, out, batch

    run([lens[0] - 1, lens[1] - 1], [lens[0] - 1, lens[1] - 1])  # prefill of all but the last token
    q, out, batch = run(lens, [1, 1])  # one decode step each
    assert torch.isfinite(out.float()).all()
    # what the cache holds: the K / k_scale, V / v_scale values rounded once to e4m3
    for i, (st, s) in enumerate(zip(starts, lens)):
        slots = [tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(s)]
        stored_k = torch.stack([cache[sl // BLOCK, KEY, :, sl % BLOCK] for sl in slots])
        want = (k_all[st : st + s].float() / k_scale).to(torch.float8_e4m3fn)
        assert torch.equal(stored_k.view(torch.uint8), want.view(torch.uint8))
    # attention over the dequantized cache (float64 reference of the kernel)
    deq = cache.float().clone()
    deq[:, KEY] *= k_scale
    deq[:, VALUE] *= v_scale
    ref = paged_attention_ref(q, deq, batch.block_table, batch.seq_lens, batch.query_start_loc, spec.scale)
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    assert float((out.double() - ref).norm() / ref.norm()) < tol
    # and attention over the unquantized K/V differs only by fp8's rounding
    exact = _attention_float(q, k_all, v_all, lens, [1, 1], spec.scale)
    assert float((out.double() - exact).norm() / exact.norm()) < 0.08


def test_fp8_cache_saturates_instead_of_nan():
    spec = AttentionSpec(num_heads=2, num_kv_heads=1, head_size=16, scale=0.25, dtype=torch.float32, kv_cache_dtype="fp8")
    backend = TritonAttentionBackend(spec, BLOCK, torch.device("cpu"))
    cache = torch.zeros(backend.kv_cache_shape(2), dtype=backend.kv_cache_torch_dtype())
    k = torch.full((1, 1, 16), 1e4)
    v = torch.full((1, 1, 16), -1e4)
    out = backend.forward(torch.randn(1, 2, 16), k, v, cache, backend.build_metadata(_batch([1], [1], [[1]])))
    assert bool((cache[1, KEY, 0, 0].float() == 448.0).all()) and bool((cache[1, VALUE, 0, 0].float() == -448.0).all())
    torch.testing.assert_close(out, torch.full_like(out, -448.0))
