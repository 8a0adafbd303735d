"""Paged attention for mixed batches: one kernel for prefill chunks and decodes, split-K.

Why one unified kernel rather than a prefill and a decode kernel: the scheduler mixes
chunked prefills (with a cached prefix) and decodes in one step, and the backend's
`forward` has written every new K/V into the cache first, so every query reads all
its context from pages. A decode is then just a sequence with one query row, and the
one code path is tested on every shape the engine produces. What decode needs beyond
that — parallelism over a long context when there are few sequences — is the split-K
(flash-decoding) dimension of the grid, combined by `_reduce_splits_kernel`.

Grid: (work item, KV head, split). A work item is `BLOCK_Q` consecutive query tokens
of one sequence; its program handles those tokens for all `GQA` query heads sharing the
KV head (rows = token x head), so each KV tile is read once per KV head and work item.
A program walks its split's share of the context in `BLOCK_N`-token tiles, gathering
slots through the block table (a tile may span pages or part of one), and keeps an
online softmax in float32 (exp2 domain). Causal and sliding-window masks come from
positions: the new tokens of a sequence sit at the end of its `seq_len` context.

Configs are fixed (see `plan_work`), not autotuned: the tile sizes follow the head size
and the batch shape, which a per-shape autotune cache would key on anyway, and the
interpreter (the CI path) would otherwise run every candidate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from ._interpret import fix_interpreter_bf16_dot
from .kv_layout import KEY, VALUE, check_kv_cache

fix_interpreter_bf16_dot()

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
#: A split below this many tiles costs more in its partial write and the reduce than it saves.
MIN_TILES_PER_SPLIT = 2


@triton.jit
def _tanh(x):
    # portable: libdevice's tanh is CUDA-only
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    part_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] float32 (NUM_SPLITS > 1)
    part_lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32, log2 domain
    q_ptr,  # [num_tokens, num_heads, head_size]
    cache_ptr,  # [num_blocks, 2, num_kv_heads, block_size, head_size]
    block_table_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    work_seq_ptr,  # [num_work] int32: sequence of each work item
    work_q_first_ptr,  # [num_work] int32: its first query row within the sequence
    scale,
    soft_cap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ckv,
    stride_ch,
    stride_cs,
    stride_bt,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GQA: tl.constexpr,
    GQA_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GQA_PAD
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = tl.load(work_seq_ptr + work)
    q_first = tl.load(work_q_first_ptr + work)
    q_begin = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - query_len  # position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_first + rows // GQA_PAD  # query row within the sequence
    group = rows % GQA_PAD
    head = kv_head * GQA + group
    row_ok = (q_tok < query_len) & (group < GQA)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    token = (q_begin + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    pos = first_pos + q_tok  # [BLOCK_M]

    # Context this work item needs: up to its last token (causal), from the window start.
    kv_end = first_pos + tl.minimum(q_first + BLOCK_Q, query_len)
    kv_begin = 0
    if SLIDING:
        kv_begin = tl.maximum(first_pos + q_first - window + 1, 0)
    tile_begin = kv_begin // BLOCK_N
    num_tiles = tl.cdiv(kv_end, BLOCK_N) - tile_begin
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = tile_begin + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, tile_begin + num_tiles)

    # A finite floor instead of -inf keeps fully masked rows NaN-free: exp2(floor - floor) = 1.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): softmax in the exp2 domain
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_ch
    for tile in range(tile_lo, tile_hi):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        page = tl.load(bt_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_off = page[:, None] * stride_cb + kv_head_off + (keys % BLOCK_SIZE)[:, None] * stride_cs + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + stride_ckv + kv_off, mask=kv_mask, other=0.0)
        if KV_FP8:  # an fp8 cache: widen to q's dtype (the scales are folded into `scale` and the output)
            k = k.to(tl.float32).to(q.dtype)
            v = v.to(tl.float32).to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] float32
        if SOFT_CAP:
            s = soft_cap * _tanh(s * (scale / soft_cap)) * 1.4426950408889634
        else:
            s = s * qk_scale
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if SLIDING:
            visible = visible & (pos[:, None] - keys[None, :] < window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        # An empty split (no tile) still writes lse = -inf so the reduce weighs it 0.
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        num_heads = GQA * tl.num_programs(1)
        part_row = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
        tl.store(part_out_ptr + part_row[:, None] * HEAD_PAD + dims[None, :], result, mask=row_ok[:, None])


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    GQA: tl.constexpr,
    GQA_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    # One program per (token, KV head): its GQA query heads, combined split by split so
    # only one [GQA_PAD, HEAD_PAD] partial is live at a time.
    token = tl.program_id(0).to(tl.int64)
    group = tl.arange(0, GQA_PAD)
    head = tl.program_id(1) * GQA + group
    head_ok = group < GQA
    dims = tl.arange(0, HEAD_PAD)
    base = (token * num_heads + head) * NUM_SPLITS  # [GQA_PAD]
    splits = tl.arange(0, NUM_SPLITS)
    lse_all = tl.load(part_lse_ptr + base[:, None] + splits[None, :], mask=head_ok[:, None], other=float("-inf"))
    top = tl.max(lse_all, axis=1)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([GQA_PAD], dtype=tl.float32)
    acc = tl.zeros([GQA_PAD, HEAD_PAD], dtype=tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        weight = tl.exp2(tl.load(part_lse_ptr + base + split, mask=head_ok, other=float("-inf")) - top)
        part = tl.load(part_out_ptr + (base + split)[:, None] * HEAD_PAD + dims[None, :], mask=head_ok[:, None], other=0.0)
        acc += part * weight[:, None]
        total += weight
    result = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(
        out_ptr + token * stride_ot + head[:, None] * stride_oh + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & (dims < HEAD_SIZE)[None, :],
    )


@dataclass(frozen=True, slots=True)
class AttentionWork:
    """How one step's attention is cut into programs (built once per step, shared by layers)."""

    # seq_idx: [num_work] int32 on the device, the sequence of each work item
    seq_idx: torch.Tensor
    # q_first: [num_work] int32 on the device, the work item's first query row in its sequence
    q_first: torch.Tensor
    block_m: int
    block_n: int
    num_splits: int
    num_tokens: int  # real tokens of the step (query_start_loc[-1])

    @property
    def num_work(self) -> int:
        return self.seq_idx.shape[0]


def block_n_for(head_size: int) -> int:
    """Keys per tile: 64, halved for wide heads so K, V and the accumulator stay in registers."""
    return 64 if triton.next_power_of_2(head_size) <= 128 else 32


def block_m_for(max_query_len: int, gqa_ratio: int) -> int:
    """Query rows (token x head) per program: 16 for decode-like steps, 64 for prefill."""
    gqa_pad = triton.next_power_of_2(gqa_ratio)
    rows = 64 if max_query_len * gqa_pad > 16 else 16
    return max(rows, gqa_pad)


def choose_num_splits(num_programs: int, max_seq_len: int, block_n: int, target_programs: int) -> int:
    """Split the context when too few programs would fill the device (a power of two).

    :param num_programs: work items x KV heads without splitting.
    :param target_programs: programs that keep the device busy (about 2 per compute unit).
    """
    if num_programs >= target_programs:
        return 1
    max_tiles = math.ceil(max_seq_len / block_n)
    wanted = math.ceil(target_programs / max(num_programs, 1))
    wanted = min(wanted, MAX_SPLITS, max(1, max_tiles // MIN_TILES_PER_SPLIT))
    return 1 << (wanted.bit_length() - 1) if wanted > 1 else 1


def plan_work(
    query_lens: Sequence[int] | np.ndarray,
    seq_lens_max: int,
    num_kv_heads: int,
    gqa_ratio: int,
    head_size: int,
    device: torch.device,
    *,
    num_splits: int | None = None,
    target_programs: int = 256,
) -> AttentionWork:
    """Cut a step into work items of `BLOCK_Q` query tokens of one sequence (host side).

    :param query_lens: new tokens of each sequence (host ints).
    :param seq_lens_max: the step's longest context.
    :param num_splits: force the split count (tests); default from `choose_num_splits`.
    """
    query_lens = np.asarray(query_lens, dtype=np.int64)
    max_query_len = int(query_lens.max()) if query_lens.size else 0
    block_m = block_m_for(max_query_len, gqa_ratio)
    block_n = block_n_for(head_size)
    block_q = block_m // triton.next_power_of_2(gqa_ratio)
    per_seq = -(-query_lens // block_q)  # ceil
    seq_idx = np.repeat(np.arange(query_lens.size, dtype=np.int32), per_seq)
    starts = np.concatenate([[0], np.cumsum(per_seq)[:-1]]) if per_seq.size else np.zeros(0, np.int64)
    q_first = ((np.arange(seq_idx.size) - np.repeat(starts, per_seq)) * block_q).astype(np.int32)
    if num_splits is None:
        num_splits = choose_num_splits(seq_idx.size * num_kv_heads, seq_lens_max, block_n, target_programs)
    elif not 1 <= num_splits <= MAX_SPLITS or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two in [1, {MAX_SPLITS}], got {num_splits}")
    return AttentionWork(
        seq_idx=torch.from_numpy(seq_idx).to(device),
        q_first=torch.from_numpy(q_first).to(device),
        block_m=block_m,
        block_n=block_n,
        num_splits=num_splits,
        num_tokens=int(query_lens.sum()),
    )


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    work: AttentionWork,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of every new token over its sequence's paged context (its own K/V included).

    :param q: [num_tokens, num_heads, head_size]
    :param kv_cache: [num_blocks, 2, num_kv_heads, block_size, head_size], new K/V already written
    :param block_table: [num_seqs, max_blocks_per_seq] int32
    :param seq_lens: [num_seqs] int32, context length including the new tokens
    :param query_start_loc: [num_seqs + 1] int32
    :param work: from `plan_work` for this step.
    :param out: [num_tokens, num_heads, head_size] to write into; rows past
        `work.num_tokens` are left as they are.
    :param workspace: (partial outputs [num_tokens, num_heads, splits, head_pad] float32,
        partial log-sum-exps [num_tokens, num_heads, splits] float32) when splitting;
        allocated when None.
    :returns: `out`.
    """
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = kv_cache.shape[2]
    block_size = check_kv_cache(kv_cache, num_kv_heads, head_size)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dimension")
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must be contiguous in its last dimension")
    if out is None:
        out = torch.empty_like(q)
    gqa = num_heads // num_kv_heads
    head_pad = triton.next_power_of_2(head_size)
    splits = work.num_splits
    if splits > 1:
        if workspace is None:
            workspace = (
                torch.empty((num_tokens, num_heads, splits, head_pad), dtype=torch.float32, device=q.device),
                torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device),
            )
        part_out, part_lse = workspace
    else:
        part_out = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
    if work.num_work == 0:
        return out
    _paged_attention_kernel[(work.num_work, num_kv_heads, splits)](
        out,
        part_out,
        part_lse,
        q,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        work.seq_idx,
        work.q_first,
        float(scale),
        float(soft_cap or 0.0),
        int(sliding_window or 0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        GQA=gqa,
        GQA_PAD=triton.next_power_of_2(gqa),
        BLOCK_M=work.block_m,
        BLOCK_N=work.block_n,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=splits,
        SLIDING=sliding_window is not None,
        SOFT_CAP=soft_cap is not None,
        # fp32 must not silently drop to tf32 (the CUDA default); fp16/bf16 keep the
        # backend's default (None), since e.g. ROCm accepts "tf32" only on some chips
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        KV_FP8=kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz),
        num_warps=4 if work.block_m <= 16 else 8 if head_pad > 128 else 4,
    )
    if splits > 1:
        _reduce_splits_kernel[(work.num_tokens, num_kv_heads)](
            out,
            part_out,
            part_lse,
            out.stride(0),
            out.stride(1),
            num_heads,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            GQA=gqa,
            GQA_PAD=triton.next_power_of_2(gqa),
            NUM_SPLITS=splits,
            num_warps=4 if triton.next_power_of_2(gqa) * head_pad >= 1024 else 1,
        )
    return out


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Float64 torch reference of `paged_attention`, one sequence at a time.

    :returns: [num_tokens, num_heads, head_size] float64; rows past query_start_loc[-1] are 0.
    """
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = kv_cache.shape[2]
    block_size = kv_cache.shape[3]
    gqa = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        seq_len = int(seq_lens[s])
        num_pages = -(-seq_len // block_size)
        pages = block_table[s, :num_pages].long().cpu()
        # context: [seq_len, num_kv_heads, head_size]
        k = kv_cache[pages, KEY].double().cpu().permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_size)[:seq_len]
        v = kv_cache[pages, VALUE].double().cpu().permute(0, 2, 1, 3).reshape(-1, num_kv_heads, head_size)[:seq_len]
        k = k.repeat_interleave(gqa, dim=1)
        v = v.repeat_interleave(gqa, dim=1)
        qs = q[start:end].double().cpu()  # [query_len, num_heads, head_size]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        keys = torch.arange(seq_len)[None, :]
        visible = keys <= pos
        if sliding_window is not None:
            visible &= pos - keys < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out
