"""CpuPagedAttentionBackend: paged attention on the host CPU with torch ops and one C kernel.

KV-cache layout (per layer): ``[num_blocks, 2, num_kv_heads, block_size, head_size]``,
K at index 0 and V at index 1 of dim 1. Block ids index dim 0 (the KVCacheAllocator
convention). Within a block each KV head's tokens are one contiguous run of
``block_size * head_size`` elements, so gathering a sequence's keys head by head reads
memory sequentially, and the gathered tensor comes out directly as
``[..., num_kv_heads, kv_len, head_size]``, the layout the matmuls and SDPA want, with
no transpose copy (the token-major layout ``[num_blocks, 2, block_size, num_kv_heads,
head_size]`` gathers up to 1.4x slower in bench_attention.py).

Every cache access goes through the cache viewed as a 2-D table of rows of
``head_size`` elements (`_rows`): row ``((block * 2 + kv) * num_kv_heads + head) *
block_size + offset``. `build_metadata` turns the block table into these row ids once
per step; `forward` then does one `index_copy_` per K and V (the write) and one
`index_select` per group of sequences (the read, each needed block read once).

How each kind of sequence is attended (choices measured in bench_attention.py):
- decodes (one new token), where the C kernel builds (native.py, paged_decode.c): one
  call for all of them, reading K/V straight from their blocks (no gather), each key once
  for all the query heads of its KV head, contexts split into parts of `native_part_len`
  keys so a few long sequences still occupy every thread; on AVX512-BF16 the dot products
  run as vdpbf16ps. 4.5x faster than the SDPA path below on the benchmark's 64 decodes,
  2x at 32 decodes of 4k keys;
- decodes otherwise (no C compiler, PORTASERVE_CPU_NATIVE=0): sorted by context length
  and cut into groups of about `decode_group_tokens` padded keys; per group one gather and one SDPA call with the
  query heads of each KV head stacked as the query rows (a decode attends to its whole
  context, so no causal mask is needed and GQA costs no K/V repeat), a boolean mask
  over the padding. Small groups keep padding low and K/V in cache: 2.2x faster than
  one padded group, 6x faster than a loop of per-sequence SDPA calls. SDPA runs in the
  model's dtype where oneDNN has hardware bf16 / fp16 matmuls (AVX512-BF16, AMX; 1.9x
  faster than float32 batched matmuls at 64 decodes on Zen5) and on a float32 upcast
  elsewhere (bf16 matmuls without hardware support are slow); softmax accumulates in
  float32 either way;
- prompts with no cached prefix: their keys are exactly the new tokens, so SDPA reads
  k/v in place (is_causal), one call per run of consecutive equal-length prompts;
- chunks on a cached prefix: one gather and one SDPA with a boolean mask each;
- encoder inputs (no cache): like prompts, without the causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from portaserve.framework.interfaces import AttentionBackend, AttentionBatch, AttentionMetadata, AttentionSpec
from portaserve.platforms.cpu import native as native_kernels
from portaserve.platforms.cpu.onednn_linear import onednn_supports

_NEG_INF = float("-inf")


@dataclass(frozen=True, slots=True)
class _DecodeGroup:
    """Decodes (one new token each) attended together, padded to the longest context."""

    num_seqs: int
    kv_len: int
    # token_idx: [num_seqs] int64, each decode's query token in the batch
    token_idx: torch.Tensor
    # rows: [2 * num_seqs * num_kv_heads * kv_len] int64 cache rows (all K rows, then all V rows)
    rows: torch.Tensor
    # mask: [num_seqs, 1, 1, kv_len] bool, False over the padding; None when there is none
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class _NativeDecodes:
    """Every decode of the step, for the C kernel (paged_decode.c), which reads K/V in place."""

    num_decodes: int
    # seq_idx, token_idx, kv_start, kv_len: [num_decodes] int32 (block-table row, query row,
    # first key position, number of keys); part_off: [num_decodes + 1] int32, each decode's
    # first context part of `part_len` keys
    seq_idx: torch.Tensor
    token_idx: torch.Tensor
    kv_start: torch.Tensor
    kv_len: torch.Tensor
    part_off: torch.Tensor
    part_len: int
    # block_table: [num_seqs, max_blocks] int32, contiguous
    block_table: torch.Tensor
    # scratch: float32, one partial result per (part, KV head)
    scratch: torch.Tensor


@dataclass(frozen=True, slots=True)
class _SeqGroup:
    """Sequences of equal query_len / kv_len that share one SDPA call (prefill chunks, encoder inputs).

    Their new tokens are consecutive in the batch: [query_start, query_start + num_seqs * query_len).
    """

    query_start: int
    num_seqs: int
    query_len: int
    kv_len: int
    # rows: [2 * num_seqs * num_kv_heads * kv_len] int64 cache rows; None when the keys are exactly
    # the new tokens (a prompt with no cached prefix, or an encoder), read from k/v directly.
    rows: torch.Tensor | None
    # mask: [query_len, kv_len] bool (True = attend); None means plain causal (or full, for encoders)
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class CpuPagedAttentionMetadata(AttentionMetadata):
    """Everything `forward` needs, computed once per step for one layer type."""

    # write_rows: [2, num_actual_tokens * num_kv_heads] int64 cache rows of the new K (0) and V (1);
    # None for encoders
    write_rows: torch.Tensor | None
    decode_groups: tuple[_DecodeGroup, ...]
    seq_groups: tuple[_SeqGroup, ...]
    # the decodes, when the C kernel attends them (decode_groups is then empty)
    native_decodes: _NativeDecodes | None = None


class CpuPagedAttentionBackend(AttentionBackend):
    """Paged attention over a host-memory KV cache.

    Ordering contract of `forward`: it FIRST writes the new K/V of every token of the
    batch into their slots (`slot_mapping`), THEN attends, reading every context token
    (new ones included) back from the cache. A sequence may therefore read blocks that
    another sequence of the same batch writes in the same step; prefix-cache sharing
    between sibling requests (n > 1) relies on this.

    Masks: causal with the offset of the cached prefix (new token i of a sequence with
    context `seq_len` and `query_len` new tokens sits at position
    `seq_len - query_len + i`); with a sliding window W, a query at position p attends to
    keys in (p - W, p] (transformers' Mistral convention: W keys, itself included).
    Encoder mode (`spec.causal` False, no cache): full bidirectional attention within
    each sequence's new tokens. Softmax is computed in float32 for every dtype.
    """

    name = "cpu_paged"
    metadata_type = CpuPagedAttentionMetadata
    platforms = frozenset({"cpu"})
    supported_dtypes = frozenset({torch.float32, torch.bfloat16, torch.float16})
    supported_kv_cache_dtypes = frozenset({"auto"})
    supported_head_sizes = None
    supported_block_sizes = frozenset({8, 16, 32, 64, 128})
    supports_sliding_window = True
    supports_encoder = True
    max_gqa_ratio = None

    #: Padded keys per decode group (see `_decode_groups`; chosen in bench_attention.py).
    decode_group_tokens: int = 2048
    #: Keys per work item of the C decode kernel: longer contexts are split (flash-decoding)
    #: so a few long sequences still keep every thread busy (chosen in bench_attention.py).
    native_part_len: int = 512
    #: Native kernel dtype codes (paged_decode.c's PS_F32 / PS_BF16 / PS_F16).
    _NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

    def __init__(self, spec: AttentionSpec, block_size: int, device: torch.device) -> None:
        super().__init__(spec, block_size, device)
        self.num_kv_heads = spec.num_kv_heads
        self.num_heads = spec.num_heads
        self.head_size = spec.head_size
        self.gqa_ratio = spec.gqa_ratio
        # a token's V row is its K row + this (see `_rows`)
        self._v_shift = spec.num_kv_heads * block_size
        # decode attention's compute dtype: the model's where the CPU multiplies it natively
        native = spec.dtype == torch.float32 or onednn_supports(spec.dtype)
        self._decode_dtype = spec.dtype if native else torch.float32
        # decodes through the C kernel where it builds (platforms/cpu/native.py), else SDPA
        self._native = native_kernels.load() if spec.causal and spec.dtype in self._NATIVE_DTYPES else None
        self._workspace = torch.empty(0, dtype=torch.float32)
        self._retired: list[torch.Tensor] = []

    # ----- layout ----------------------------------------------------------------------

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``[num_blocks, 2, num_kv_heads, block_size, head_size]`` (K = 0, V = 1 on dim 1)."""
        return (num_blocks, 2, self.num_kv_heads, self.block_size, self.head_size)

    def _rows(self, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Cache rows of K for every (token, kv head): [..., num_kv_heads] from [...] blocks/offsets.

        The V row of the same token and head is the K row + num_kv_heads * block_size.
        """
        heads = torch.arange(self.num_kv_heads, dtype=torch.int64)
        base = blocks.to(torch.int64) * (2 * self.num_kv_heads * self.block_size) + offsets.to(torch.int64)
        return base.unsqueeze(-1) + heads * self.block_size

    # ----- metadata --------------------------------------------------------------------

    def build_metadata(self, batch: AttentionBatch) -> CpuPagedAttentionMetadata:
        """Split decodes from prefills and turn block tables into cache row ids (once per step)."""
        num_tokens = batch.num_actual_tokens
        qsl = batch.query_start_loc.to(torch.int64)
        seq_lens = batch.seq_lens.to(torch.int64)
        query_lens = qsl[1:] - qsl[:-1]
        if not self.spec.causal:
            groups = self._runs(qsl.tolist(), query_lens.tolist(), query_lens.tolist(), None)
            return CpuPagedAttentionMetadata(num_tokens, None, (), tuple(groups))

        bs = self.block_size
        slots = batch.slot_mapping[:num_tokens].to(torch.int64)
        k_rows = self._rows(slots // bs, slots % bs).reshape(-1)
        write_rows = torch.stack([k_rows, k_rows + self._v_shift])

        block_table = batch.block_table.to(torch.int64)
        window = self.spec.sliding_window
        first_query_pos = seq_lens - query_lens
        # First key each sequence needs: a window drops keys older than its first query's reach.
        kv_start = torch.zeros_like(seq_lens)
        if window is not None:
            kv_start = (first_query_pos - window + 1).clamp(min=0)
        kv_lens = seq_lens - kv_start

        is_decode = query_lens == 1
        decode_idx = torch.nonzero(is_decode).flatten()
        native_decodes = None
        if self._native is not None and decode_idx.numel():
            native_decodes = self._native_decodes(decode_idx, qsl, kv_start, kv_lens, batch.block_table, batch.max_seq_len)
            decode_groups = ()
        else:
            decode_groups = self._decode_groups(decode_idx, qsl, kv_start, kv_lens, block_table)

        seq_groups: list[_SeqGroup] = []
        qsl_list, qlen_list = qsl.tolist(), query_lens.tolist()
        start_list, kvlen_list = kv_start.tolist(), kv_lens.tolist()
        fresh: list[int] = []  # run of prompts with no cached prefix, batched by `_runs`
        for i in torch.nonzero(query_lens > 1).flatten().tolist():
            if start_list[i] == 0 and kvlen_list[i] == qlen_list[i]:
                if fresh and fresh[-1] != i - 1:
                    seq_groups += self._runs(qsl_list, qlen_list, qlen_list, fresh)
                    fresh = []
                fresh.append(i)
                continue
            pos = torch.arange(start_list[i], start_list[i] + kvlen_list[i], dtype=torch.int64)
            rows = self._rows(block_table[i, pos // bs], pos % bs).t()  # [kv_heads, kv_len]
            q_pos = torch.arange(int(first_query_pos[i]), int(seq_lens[i]), dtype=torch.int64)
            seq_groups.append(
                _SeqGroup(
                    query_start=qsl_list[i],
                    num_seqs=1,
                    query_len=qlen_list[i],
                    kv_len=kvlen_list[i],
                    rows=torch.stack([rows, rows + self._v_shift]).reshape(-1),
                    mask=self._causal_mask(q_pos, pos),
                )
            )
        if fresh:
            seq_groups += self._runs(qsl_list, qlen_list, qlen_list, fresh)
        return CpuPagedAttentionMetadata(num_tokens, write_rows, decode_groups, tuple(seq_groups), native_decodes)

    def _native_decodes(self, idx, qsl, kv_start, kv_lens, block_table, max_seq_len: int) -> _NativeDecodes:
        """The C kernel's view of the decodes: int32 arrays and the context split into parts.

        The scratch is sized for every decode at `max_seq_len` keys, not for this step's
        parts: a padded decode batch (decode_graphs.py, max_seq_len fixed) then keeps the
        same shapes while its sequences grow, so a recorded graph stays valid."""
        part_len = self.native_part_len
        kv_len = kv_lens[idx]
        parts = torch.zeros(idx.numel() + 1, dtype=torch.int64)
        torch.cumsum((kv_len + part_len - 1) // part_len, 0, out=parts[1:])
        num_parts = max(int(parts[-1]), idx.numel() * -(-max(max_seq_len, 1) // part_len))
        ratio = self.num_heads // self.num_kv_heads
        scratch = torch.empty(self._native.scratch_floats(num_parts, self.num_kv_heads, ratio, self.head_size),
                              dtype=torch.float32)
        return _NativeDecodes(
            num_decodes=idx.numel(),
            seq_idx=idx.to(torch.int32),
            token_idx=qsl[idx].to(torch.int32),
            kv_start=kv_start[idx].to(torch.int32),
            kv_len=kv_len.to(torch.int32),
            part_off=parts.to(torch.int32),
            part_len=part_len,
            block_table=block_table.to(torch.int32).contiguous(),
            scratch=scratch,
        )

    def _causal_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[len(q_pos), len(k_pos)] bool: key position <= query position, within the window."""
        allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
        if self.spec.sliding_window is not None:
            allowed &= k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - self.spec.sliding_window
        return allowed

    def _runs(self, qsl: list[int], qlens: list[int], kvlens: list[int], seqs: list[int] | None) -> list[_SeqGroup]:
        """Group consecutive sequences whose keys are exactly their new tokens by equal length."""
        if seqs is None:
            seqs = [i for i, n in enumerate(qlens) if n > 0]
        groups: list[_SeqGroup] = []
        i = 0
        while i < len(seqs):
            j = i + 1
            while j < len(seqs) and seqs[j] == seqs[j - 1] + 1 and qlens[seqs[j]] == qlens[seqs[i]]:
                j += 1
            n = qlens[seqs[i]]
            mask = None
            if self.spec.causal and self.spec.sliding_window is not None and n > self.spec.sliding_window:
                pos = torch.arange(n, dtype=torch.int64)
                mask = self._causal_mask(pos, pos)
            groups.append(_SeqGroup(qsl[seqs[i]], j - i, n, kvlens[seqs[i]], None, mask))
            i = j
        return groups

    def _decode_groups(self, idx, qsl, kv_start, kv_lens, block_table) -> tuple[_DecodeGroup, ...]:
        """Decodes sorted by context length, cut into groups of at most `decode_group_tokens`
        padded keys: little padding, and each group's K/V stays in cache between the matmuls."""
        if idx.numel() == 0:
            return ()
        bs = self.block_size
        lens = kv_lens[idx]
        order = torch.argsort(lens, descending=True, stable=True)
        idx, lens = idx[order], lens[order]
        # Every decode's keys at once, padded to the longest context; groups take slices.
        max_width = int(lens[0])
        j = torch.arange(max_width, dtype=torch.int64)
        valid = j < lens.unsqueeze(1)  # [num_decodes, max_width]
        # Padding re-reads the sequence's first key (always written, hence finite);
        # the -inf mask gives it zero weight. (Gathering whole [block_size, head_size]
        # chunks instead of rows, zeroing the never-written tail, measured no faster.)
        pos = kv_start[idx].unsqueeze(1) + torch.where(valid, j, 0)
        blocks = torch.gather(block_table[idx], 1, pos // bs)
        # base: [num_decodes, max_width] cache row of KV head 0's K
        base = blocks * (2 * self.num_kv_heads * bs) + pos % bs
        head_offsets = (torch.arange(self.num_kv_heads, dtype=torch.int64) * bs).view(1, -1, 1)
        token_idx = qsl[idx]
        lens_list = lens.tolist()
        groups = []
        start = 0
        while start < len(lens_list):
            width = lens_list[start]  # the longest of the group (sorted)
            stop = min(len(lens_list), start + max(1, self.decode_group_tokens // max(width, 1)))
            rows = base[start:stop, :width].unsqueeze(1) + head_offsets  # [n, kv_heads, width]
            mask = None
            if lens_list[stop - 1] != width:
                mask = valid[start:stop, :width].reshape(stop - start, 1, 1, width)
            groups.append(
                _DecodeGroup(
                    num_seqs=stop - start,
                    kv_len=width,
                    token_idx=token_idx[start:stop],
                    rows=torch.stack([rows, rows + self._v_shift]).reshape(-1),
                    mask=mask,
                )
            )
            start = stop
        return tuple(groups)

    # ----- forward ---------------------------------------------------------------------

    def _forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the new K/V into their cache slots, then attend (see the class docstring)."""
        md: CpuPagedAttentionMetadata = metadata  # type: ignore[assignment]  (forward checked it)
        # out: [num_tokens, num_heads, head_size], contiguous (the C kernel writes it by offset)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        table = None
        if self.spec.causal:
            n, d = md.num_actual_tokens, self.head_size
            # table: [num_blocks * 2 * num_kv_heads * block_size, head_size]
            table = kv_cache.view(-1, d)
            if self._native is not None and k.stride(-1) == 1 and v.stride(-1) == 1 and k.dtype == v.dtype == kv_cache.dtype:
                # one C call, reading V in place from the qkv projection (no contiguous copy)
                rows = md.write_rows
                rc = self._native.kv_write(table.data_ptr(), rows[0].data_ptr(), rows[1].data_ptr(), k.data_ptr(),
                                           k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), n,
                                           self.num_kv_heads, d, k.element_size())
                if rc != 0:
                    raise RuntimeError(f"{self.name}: the C KV-cache write got a negative cache row")
            else:
                table.index_copy_(0, md.write_rows[0], k[:n].reshape(-1, d))
                table.index_copy_(0, md.write_rows[1], v[:n].reshape(-1, d))
        if md.native_decodes is not None:
            self._native_decode(q, kv_cache, md.native_decodes, out)
        for group in md.decode_groups:
            self._decode(q, table, group, out)
        for group in md.seq_groups:
            self._seq_group(q, k, v, table, group, out)
        return out

    def _native_decode(self, q: torch.Tensor, kv_cache: torch.Tensor, nd: _NativeDecodes, out: torch.Tensor) -> None:
        d = self.head_size
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        threads = torch.get_num_threads()
        ratio = self.num_heads // self.num_kv_heads
        need = threads * self._native.workspace_floats(ratio, d, nd.part_len)
        if self._workspace.numel() < need:
            # the old one stays alive: a recorded decode graph (graphs.py) may point at it
            self._retired.append(self._workspace)
            self._workspace = torch.empty(need, dtype=torch.float32)
        cap = self.spec.logits_soft_cap
        rc = self._native.paged_decode(
            q.data_ptr(), q.stride(0), kv_cache.data_ptr(), nd.block_table.data_ptr(), nd.block_table.stride(0),
            nd.seq_idx.data_ptr(), nd.token_idx.data_ptr(), nd.kv_start.data_ptr(), nd.kv_len.data_ptr(),
            nd.part_off.data_ptr(), out.data_ptr(), nd.num_decodes, self.num_heads, self.num_kv_heads, d,
            self.block_size, self._NATIVE_DTYPES[q.dtype], self.spec.scale, float(cap or 0.0), nd.part_len,
            nd.scratch.data_ptr(), self._workspace.data_ptr(), threads,
        )
        if rc != 0:
            raise RuntimeError(f"{self.name}: the C decode kernel rejected its arguments (code {rc})")

    def _decode(self, q: torch.Tensor, table: torch.Tensor, g: _DecodeGroup, out: torch.Tensor) -> None:
        n, hkv, ratio, d, kvl = g.num_seqs, self.num_kv_heads, self.gqa_ratio, self.head_size, g.kv_len
        dt = self._decode_dtype
        # kv: [2, n, num_kv_heads, kv_len, head_size]
        kv = table.index_select(0, g.rows).view(2, n, hkv, kvl, d).to(dt)
        # qd: [n, num_kv_heads, gqa_ratio, head_size]: the query heads of each KV head as query rows
        qd = q.index_select(0, g.token_idx).view(n, hkv, ratio, d).to(dt)
        cap = self.spec.logits_soft_cap
        if cap is None:
            res = F.scaled_dot_product_attention(qd, kv[0], kv[1], attn_mask=g.mask, scale=self.spec.scale)
        else:  # SDPA has no soft cap: explicit float32 scores
            scores = torch.matmul(qd.float(), kv[0].float().transpose(-1, -2))
            scores.mul_(self.spec.scale / cap).tanh_().mul_(cap)
            if g.mask is not None:
                scores.masked_fill_(~g.mask, _NEG_INF)
            res = torch.matmul(torch.softmax(scores, dim=-1), kv[1].float())
        out.index_copy_(0, g.token_idx, res.reshape(n, self.num_heads, d).to(out.dtype))

    def _seq_group(self, q, k, v, table, g: _SeqGroup, out: torch.Tensor) -> None:
        n, ql, kvl, d = g.num_seqs, g.query_len, g.kv_len, self.head_size
        a, b = g.query_start, g.query_start + n * ql
        # qs: [n, num_heads, query_len, head_size], a strided view SDPA reads in place
        # (contiguous copies or a float32 upcast measured no faster, bench_attention.py)
        qs = q[a:b].view(n, ql, self.num_heads, d).transpose(1, 2)
        if g.rows is None:
            ks = k[a:b].view(n, ql, self.num_kv_heads, d).transpose(1, 2)
            vs = v[a:b].view(n, ql, self.num_kv_heads, d).transpose(1, 2)
        else:
            kv = table.index_select(0, g.rows).view(2, n, self.num_kv_heads, kvl, d)
            ks, vs = kv[0], kv[1]
        causal = self.spec.causal and g.mask is None
        res = self._sdpa(qs, ks, vs, g.mask, causal)
        out[a:b].view(n, ql, self.num_heads, d).copy_(res.transpose(1, 2))

    def _sdpa(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        """Attention of q [B, H, Lq, D] over k/v [B, Hkv, L, D]; mask [Lq, L] bool or None."""
        if self.spec.logits_soft_cap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.spec.scale, enable_gqa=self.gqa_ratio > 1
            )
        # SDPA has no soft cap: explicit float32 path, query heads grouped per KV head.
        cap = self.spec.logits_soft_cap
        b, h, lq, d = q.shape
        hkv, kvl = k.shape[1], k.shape[2]
        qg = q.reshape(b, hkv, self.gqa_ratio * lq, d).float()
        scores = torch.matmul(qg, k.float().transpose(-1, -2))
        scores.mul_(self.spec.scale / cap).tanh_().mul_(cap)
        scores = scores.view(b, hkv, self.gqa_ratio, lq, kvl)
        if causal:
            mask = torch.ones(lq, kvl, dtype=torch.bool).tril(kvl - lq)
        if mask is not None:
            scores.masked_fill_(~mask, _NEG_INF)
        probs = torch.softmax(scores, dim=-1).view(b, hkv, self.gqa_ratio * lq, kvl)
        return torch.matmul(probs, v.float()).view(b, h, lq, d).to(q.dtype)
