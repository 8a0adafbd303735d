"""Every Triton kernel of portaserve.kernels against its float64 torch reference, on CPU
through the Triton interpreter, on fresh random inputs.

With ``PORTASERVE_TRITON_TEST_DEVICE=cuda`` (any torch device other than cpu) the same tests
run the compiled kernels on that device instead, with TRITON_INTERPRET unset
(ci/gpu_check.sh does this on a GPU machine).

Outputs (and unused cache slots) are NaN-poisoned before each run, so an element a
kernel fails to write, or a slot it reads without being given it, shows as an error.
Sizes are tiny: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os

import pytest
import torch

from portaserve.kernels._interpret import interpreter_env

#: cpu: the interpreter (CI); another torch device: the compiled kernels there (a GPU check)
DEVICE = torch.device(os.environ.get("PORTASERVE_TRITON_TEST_DEVICE") or "cpu")
INTERPRET = DEVICE.type == "cpu"

with interpreter_env() if INTERPRET else contextlib.nullcontext():  # triton and the kernels are decorated (interpreted or compiled) on import
    pytest.importorskip("triton")
    from portaserve.kernels.activation import silu_and_mul, silu_and_mul_ref
    from portaserve.kernels.kv_layout import kv_cache_shape
    from portaserve.kernels.paged_attention import (
        MAX_SPLITS,
        choose_num_splits,
        paged_attention,
        paged_attention_ref,
        plan_work,
    )
    from portaserve.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
    from portaserve.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
    from portaserve.kernels.rotary import rotary_embedding, rotary_embedding_ref


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    """TRITON_INTERPRET=1 while each test runs (triton reads it at launch too), and only then;
    on a GPU, TRITON_INTERPRET unset and tensors created on DEVICE by default."""
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        yield
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with DEVICE:
        yield


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}
NAN = float("nan")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    return err if math.isfinite(err) else math.inf


def dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----- paged setups ---------------------------------------------------------------------


class Paged:
    """A batch of sequences over a NaN-poisoned paged cache with shuffled block ids.

    `seqs` = [(cached_prefix_len, query_len)]; the cache holds K/V for every position
    of every sequence (prefix and new tokens), nothing else.
    """

    def __init__(self, seqs, block_size, num_kv_heads, gqa, head_size, dtype, gen, spare_blocks=3):
        self.seqs = seqs
        seq_lens = [c + q for c, q in seqs]
        pages = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(pages) + spare_blocks
        pool = torch.randperm(num_blocks, generator=gen).tolist()
        self.cache = torch.full(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size), NAN, dtype=dtype)
        self.block_table = torch.zeros(len(seqs), max(pages), dtype=torch.int32)
        for s, n in enumerate(seq_lens):
            table = [pool.pop() for _ in range(pages[s])]
            self.block_table[s, : pages[s]] = torch.tensor(table, dtype=torch.int32)
            for p in range(n):
                kv = torch.randn(2, num_kv_heads, head_size, generator=gen).to(dtype)
                self.cache[table[p // block_size], :, :, p % block_size] = kv
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.query_lens = [q for _c, q in seqs]
        self.query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        self.query_start_loc[1:] = torch.cumsum(torch.tensor(self.query_lens), 0)
        self.num_tokens = int(self.query_start_loc[-1])
        self.q = torch.randn(self.num_tokens, num_kv_heads * gqa, head_size, generator=gen).to(dtype)


def run_attention(paged: Paged, *, num_splits=1, scale=None, sliding_window=None, soft_cap=None, padding=0):
    num_kv_heads, head_size = paged.cache.shape[2], paged.cache.shape[4]
    gqa = paged.q.shape[1] // num_kv_heads
    scale = scale if scale is not None else 1.3 / math.sqrt(head_size)
    q = paged.q
    if padding:  # static-shape padding rows past the real tokens: must be left alone
        q = torch.cat([q, torch.randn(padding, *q.shape[1:]).to(q.dtype)])
    work = plan_work(paged.query_lens, int(paged.seq_lens.max()), num_kv_heads, gqa, head_size, q.device, num_splits=num_splits)
    out = torch.full_like(q, NAN)
    workspace = None
    if num_splits > 1:
        head_pad = 1 << (head_size - 1).bit_length()
        workspace = (
            torch.full((q.shape[0], q.shape[1], num_splits, head_pad), NAN),
            torch.full((q.shape[0], q.shape[1], num_splits), NAN),
        )
    paged_attention(
        q,
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        paged.query_start_loc,
        work,
        scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        out=out,
        workspace=workspace,
    )
    ref = paged_attention_ref(
        paged.q, paged.cache, paged.block_table, paged.seq_lens, paged.query_start_loc, scale,
        sliding_window=sliding_window, soft_cap=soft_cap,
    )
    if padding:
        assert torch.isnan(out[paged.num_tokens :]).all(), "padding rows were written"
    return rel_err(out[: paged.num_tokens], ref[: paged.num_tokens])


def mixed_seqs(bs: int):
    """A fresh prefill, decodes over partly filled blocks, a chunk on a cached prefix
    crossing a block boundary, and a one-token prefill of a fresh sequence."""
    return [(0, bs + 3), (2 * bs + 5, 1), (bs + 5, bs + 6), (3 * bs - 1, 1), (0, 1)]


# ----- paged attention: the grid ----------------------------------------------------------

GRID = list(itertools.product((64, 128), (16, 32), (1, 4, 8), DTYPES))


@pytest.mark.parametrize(
    ("head_size", "block_size", "gqa", "dtype"), GRID, ids=[f"d{h}-bs{b}-gqa{g}-{dname(t)}" for h, b, g, t in GRID]
)
@pytest.mark.grid(keep=2)
def test_paged_attention_grid(head_size, block_size, gqa, dtype):
    gen = generator(head_size * 1000 + block_size * 10 + gqa)
    paged = Paged(mixed_seqs(block_size), block_size, 2, gqa, head_size, dtype, gen)
    err = run_attention(paged, padding=2)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]:g}"


@pytest.mark.grid(keep=1)
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("num_splits", (2, 4, 8))
def test_paged_attention_split_k(num_splits, dtype):
    # long decodes (the flash-decoding case) next to a short prefill; with 8 splits some
    # splits of the shorter contexts own no tile and must weigh zero in the reduce
    gen = generator(num_splits)
    paged = Paged([(150, 1), (9, 1), (40, 3), (97, 1)], 16, 2, 4, 64, dtype, gen)
    err = run_attention(paged, num_splits=num_splits)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]:g}"


@pytest.mark.grid(keep=1)
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("window", (1, 7, 40))
def test_paged_attention_sliding_window(window, dtype):
    gen = generator(window)
    paged = Paged(mixed_seqs(16) + [(80, 1)], 16, 2, 4, 64, dtype, gen)
    err = run_attention(paged, sliding_window=window, num_splits=2 if window == 40 else 1)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]:g}"


@pytest.mark.grid(keep=1)
@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
def test_paged_attention_soft_cap(dtype):
    gen = generator(5)
    paged = Paged(mixed_seqs(16), 16, 2, 4, 64, dtype, gen)
    # scale 1.0 gives logits of ~8: a cap of 3 changes the answer a lot
    err = run_attention(paged, scale=1.0, soft_cap=3.0)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]:g}"
    err = run_attention(paged, scale=1.0, soft_cap=3.0, sliding_window=9)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]:g} (soft cap + window)"


@pytest.mark.parametrize(
    ("head_size", "block_size", "gqa"),
    [(80, 16, 2), (96, 64, 1), (256, 32, 2), (32, 16, 16), (16, 16, 2)],
    ids=["d80-padded", "bs64", "d256", "gqa16", "d16"],
)
@pytest.mark.grid(keep=1)
def test_paged_attention_other_shapes(head_size, block_size, gqa):
    gen = generator(head_size + gqa)
    paged = Paged([(0, 21), (block_size + 3, 1), (5, 9)], block_size, 2, gqa, head_size, torch.float32, gen)
    err = run_attention(paged)
    assert err <= TOL[torch.float32], f"relative error {err:.3g}"


def test_paged_attention_mqa_and_empty_query():
    # MQA (one KV head) and a scheduled sequence with no new tokens this step
    gen = generator(11)
    paged = Paged([(20, 4), (33, 0), (0, 17)], 16, 1, 8, 64, torch.float32, gen)
    assert run_attention(paged) <= TOL[torch.float32]


def test_reference_masks_by_hand():
    # the reference's causal/window semantics on a 3-token case computed by hand
    cache = torch.zeros(kv_cache_shape(1, 16, 1, 16), dtype=torch.float64)
    cache[0, 1, 0, :3, 0] = torch.tensor([1.0, 2.0, 4.0])  # values; keys all zero -> uniform weights
    q = torch.zeros(2, 1, 16, dtype=torch.float64)
    args = (q, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32), 1.0)
    out = paged_attention_ref(*args)
    assert out[:, 0, 0].tolist() == pytest.approx([(1 + 2) / 2, (1 + 2 + 4) / 3])
    out = paged_attention_ref(*args, sliding_window=2)
    assert out[:, 0, 0].tolist() == pytest.approx([(1 + 2) / 2, (2 + 4) / 2])


# ----- work planning (host logic) ---------------------------------------------------------


def test_plan_work_covers_every_query_row_once():
    query_lens = [1, 37, 0, 16, 1, 5]
    for gqa in (1, 4, 8, 16):
        work = plan_work(query_lens, 100, 2, gqa, 128, torch.device("cpu"), num_splits=1)
        block_q = work.block_m // (1 << (gqa - 1).bit_length())
        covered = set()
        for s, first in zip(work.seq_idx.tolist(), work.q_first.tolist()):
            rows = range(first, min(first + block_q, query_lens[s]))
            assert rows, "a work item with no query row"
            covered |= {(s, r) for r in rows}
        assert covered == {(s, r) for s, n in enumerate(query_lens) for r in range(n)}
        assert work.num_tokens == sum(query_lens)


def test_choose_num_splits():
    # plenty of programs: no split; few programs over a long context: split, power of two
    assert choose_num_splits(num_programs=512, max_seq_len=8192, block_n=64, target_programs=264) == 1
    splits = choose_num_splits(num_programs=8, max_seq_len=8192, block_n=64, target_programs=264)
    assert splits == MAX_SPLITS
    assert choose_num_splits(num_programs=64, max_seq_len=8192, block_n=64, target_programs=264) == 4
    # a short context is not split below MIN_TILES_PER_SPLIT tiles per split
    assert choose_num_splits(num_programs=1, max_seq_len=128, block_n=64, target_programs=264) == 1
    assert choose_num_splits(num_programs=1, max_seq_len=300, block_n=64, target_programs=264) == 2
    with pytest.raises(ValueError, match="num_splits"):
        plan_work([1], 10, 1, 1, 64, torch.device("cpu"), num_splits=3)


# ----- reshape_and_cache ------------------------------------------------------------------

CACHE_GRID = list(itertools.product((64, 128), (16, 32), (1, 4), DTYPES))


@pytest.mark.parametrize(
    ("head_size", "block_size", "num_kv_heads", "dtype"),
    CACHE_GRID,
    ids=[f"d{h}-bs{b}-kv{k}-{dname(t)}" for h, b, k, t in CACHE_GRID],
)
@pytest.mark.grid(keep=2)
def test_reshape_and_cache(head_size, block_size, num_kv_heads, dtype):
    gen = generator(head_size + block_size + num_kv_heads)
    num_blocks, num_tokens, num_padding = 5, 2 * block_size + 3, 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[: num_tokens + num_padding]
    # padding rows point at a live token's slot: writing them would corrupt it
    slots[num_tokens:] = slots[0]
    key = torch.randn(num_tokens + num_padding, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens + num_padding, num_kv_heads, head_size, generator=gen).to(dtype)
    # a strided view like the model's qkv split: rows farther apart than num_kv_heads * head_size
    fused = torch.cat([key, value], dim=1)
    key_view, value_view = fused[:, :num_kv_heads], fused[:, num_kv_heads:]
    cache = torch.full(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size), NAN, dtype=dtype)
    expected = cache.clone()
    reshape_and_cache(key_view, value_view, cache, slots, num_tokens=num_tokens)
    reshape_and_cache_ref(key, value, expected, slots, num_tokens=num_tokens)
    assert torch.equal(torch.isnan(cache), torch.isnan(expected)), "wrong slots written"
    assert torch.equal(torch.nan_to_num(cache), torch.nan_to_num(expected))
    assert int((~torch.isnan(cache)).sum()) == num_tokens * 2 * num_kv_heads * head_size


# ----- rms norm, silu-and-mul, rotary -----------------------------------------------------

NORM_SHAPES = [(5, 96), (3, 4, 128), (2, 1000)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm(shape, dtype):
    gen = generator(sum(shape))
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    out = torch.full(shape, NAN, dtype=dtype)
    rms_norm(x, weight, 1e-5, out=out)
    err = rel_err(out, rms_norm_ref(x, weight, 1e-5))
    assert err <= TOL[dtype], f"relative error {err:.3g}"
    # a strided input (a column slice), allocated output
    wide = torch.randn(*shape[:-1], shape[-1] + 7, generator=gen).to(dtype)
    view = wide[..., 3 : 3 + shape[-1]]
    err = rel_err(rms_norm(view, weight, 1e-5), rms_norm_ref(view, weight, 1e-5))
    assert err <= TOL[dtype], f"relative error {err:.3g} (strided input)"


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_add_rms_norm(shape, dtype):
    gen = generator(sum(shape) + 1)
    x = torch.randn(shape, generator=gen).to(dtype)
    residual = (4 * torch.randn(shape, generator=gen)).to(dtype)
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out = torch.full(shape, NAN, dtype=dtype)
    new_residual = torch.full(shape, NAN, dtype=dtype)
    fused_add_rms_norm(x, residual, weight, 1e-6, out=out, residual_out=new_residual)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert rel_err(out, ref_out) <= TOL[dtype]
    assert rel_err(new_residual, ref_residual) <= TOL[dtype]
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs modified"
    # the norm is of the rounded residual that is handed on (fused == unfused)
    assert rel_err(out, rms_norm_ref(new_residual, weight, 1e-6)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=dname)
@pytest.mark.parametrize("shape", [(4, 2 * 64), (3, 2, 2 * 1500), (1, 2 * 11)], ids=lambda s: "x".join(map(str, s)))
def test_silu_and_mul(shape, dtype):
    gen = generator(sum(shape))
    x = (2 * torch.randn(shape, generator=gen)).to(dtype)
    out = torch.full((*shape[:-1], shape[-1] // 2), NAN, dtype=dtype)
    silu_and_mul(x, out=out)
    err = rel_err(out, silu_and_mul_ref(x))
    assert err <= TOL[dtype], f"relative error {err:.3g}"


def _cos_sin_cache(max_pos: int, rotary_dim: int, dtype: torch.dtype) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


ROPE_GRID = list(itertools.product((True, False), (64, 128), DTYPES))


@pytest.mark.parametrize(
    ("is_neox", "head_size", "dtype"), ROPE_GRID, ids=[f"{'neox' if n else 'gptj'}-d{h}-{dname(t)}" for n, h, t in ROPE_GRID]
)
@pytest.mark.grid(keep=2)
def test_rotary_embedding(is_neox, head_size, dtype):
    gen = generator(head_size + is_neox)
    num_tokens, num_heads, num_kv_heads = 7, 4, 2
    positions = torch.randint(0, 200, (num_tokens,), generator=gen)
    cache = _cos_sin_cache(256, head_size, torch.float32)
    # q and k as strided views of one fused projection, like a qkv split
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_size, generator=gen).to(dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    q_before = q.clone()
    q_out = torch.full(q.shape, NAN, dtype=dtype)
    k_out = torch.full(k.shape, NAN, dtype=dtype)
    rotary_embedding(positions, q, k, cache, is_neox, q_out=q_out, k_out=k_out)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache, is_neox)
    assert rel_err(q_out, q_ref) <= TOL[dtype]
    assert rel_err(k_out, k_ref) <= TOL[dtype]
    assert torch.equal(q, q_before), "q modified"


@pytest.mark.parametrize("is_neox", (True, False), ids=("neox", "gptj"))
def test_rotary_partial_and_flat(is_neox):
    gen = generator(3)
    positions = torch.randint(0, 64, (5,), generator=gen)
    # partial rotary: only the first 32 of 80 dims rotate, the rest pass through
    cache = _cos_sin_cache(64, 32, torch.float32)
    q = torch.randn(5, 3, 80, generator=gen)
    k = torch.randn(5, 1, 80, generator=gen)
    q_out, k_out = rotary_embedding(positions, q, k, cache, is_neox)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache, is_neox)
    assert rel_err(q_out, q_ref) <= 1e-5 and rel_err(k_out, k_ref) <= 1e-5
    assert torch.equal(q_out[..., 32:], q[..., 32:])
    # flat [num_tokens, num_heads * head_size] inputs (head_size == rotary dim)
    cache = _cos_sin_cache(64, 64, torch.float32)
    q = torch.randn(5, 4 * 64, generator=gen)
    k = torch.randn(5, 2 * 64, generator=gen)
    q_out, k_out = rotary_embedding(positions, q, k, cache, is_neox)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache, is_neox)
    assert q_out.shape == q.shape and rel_err(q_out, q_ref) <= 1e-5 and rel_err(k_out, k_ref) <= 1e-5


def test_rotary_reference_by_hand():
    # position 1, one pair rotated by 90 degrees: (x1, x2) -> (-x2, x1)
    cache = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # rows: [cos, sin] at positions 0, 1
    q = torch.tensor([[[3.0, 5.0]]])
    q_ref, _ = rotary_embedding_ref(torch.tensor([1]), q, q, cache, True)
    assert q_ref.flatten().tolist() == [-5.0, 3.0]
