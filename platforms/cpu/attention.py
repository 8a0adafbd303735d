"""CpuPagedAttentionBackend: paged attention on the host CPU with plain torch ops.

KV-cache layout (per layer): ``[num_blocks, 2, num_kv_heads, block_size, head_size]``,
K at index 0 and V at index 1 of dim 1. Block ids index dim 0 (the KVCacheAllocator
convention). Within a block each KV head's tokens are one contiguous run of
``block_size * head_size`` elements, so gathering a sequence's keys head by head reads
memory sequentially, and the gathered tensor comes out directly as
``[..., num_kv_heads, kv_len, head_size]``, the layout the matmuls and SDPA want,
with no transpose copy (see bench_attention.py for the measurement).

Every cache access goes through the cache viewed as a 2-D table of rows of
``head_size`` elements (`_rows`): row ``((block * 2 + kv) * num_kv_heads + head) *
block_size + offset``. `build_metadata` turns the block table into these row ids once
per step; `forward` then does one `index_copy_` per K and V (the write) and one
`index_select` per group of sequences (the read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from portaserve.framework.interfaces import AttentionBackend, AttentionBatch, AttentionMetadata, AttentionSpec

_NEG_INF = float("-inf")


@dataclass(frozen=True, slots=True)
class _PrefillSeq:
    """One sequence with more than one new token (a prefill chunk), attended on its own."""

    # [query_start, query_end) of its new tokens in the batch
    query_start: int
    query_end: int
    # kv_rows: [2 * num_kv_heads * kv_len] int64 cache rows (K rows, then V rows)
    kv_rows: torch.Tensor | None
    kv_len: int
    # mask: [query_len, kv_len] bool (True = attend), None when plain causal from position 0
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class CpuPagedAttentionMetadata(AttentionMetadata):
    """Everything `forward` needs, computed once per step for one layer type."""

    # write_rows: [2, num_actual_tokens * num_kv_heads] int64 cache rows of the new K (0) and V (1)
    write_rows: torch.Tensor | None
    # --- decodes (query_len == 1), batched together ---
    num_decodes: int
    # decode_token_idx: [num_decodes] int64 index of each decode's query token in the batch
    decode_token_idx: torch.Tensor | None
    # True when the decodes are exactly tokens [0, num_decodes) in order (no scatter needed)
    decodes_first: bool
    # decode_rows: [2 * num_decodes * num_kv_heads * decode_kv_len] int64 cache rows
    decode_rows: torch.Tensor | None
    decode_kv_len: int
    # decode_mask: [num_decodes, 1, 1, decode_kv_len] float32, 0 or -inf (padding past each context)
    decode_mask: torch.Tensor | None
    # --- prefill chunks, one SDPA call each ---
    prefills: tuple[_PrefillSeq, ...]
    # --- encoder mode (no KV cache): [start, end) of each sequence ---
    encoder_seqs: tuple[tuple[int, int], ...]


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
    platforms = frozenset({"cpu"})
    supported_dtypes = frozenset({torch.float32, torch.bfloat16, torch.float16})
    supported_kv_cache_dtypes = frozenset({"auto"})
    supported_head_sizes = None
    supported_block_sizes = frozenset({8, 16, 32, 64, 128})
    supports_sliding_window = True
    supports_encoder = True
    max_gqa_ratio = None

    def __init__(self, spec: AttentionSpec, block_size: int, device: torch.device) -> None:
        super().__init__(spec, block_size, device)
        self.num_kv_heads = spec.num_kv_heads
        self.num_heads = spec.num_heads
        self.head_size = spec.head_size
        self.gqa_ratio = spec.gqa_ratio

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
        num_seqs = batch.num_seqs

        if not self.spec.causal:
            bounds = tuple((int(a), int(b)) for a, b in zip(qsl[:-1].tolist(), qsl[1:].tolist()) if b > a)
            return CpuPagedAttentionMetadata(
                num_actual_tokens=num_tokens,
                write_rows=None,
                num_decodes=0,
                decode_token_idx=None,
                decodes_first=False,
                decode_rows=None,
                decode_kv_len=0,
                decode_mask=None,
                prefills=(),
                encoder_seqs=bounds,
            )

        bs = self.block_size
        v_shift = self.num_kv_heads * bs
        slots = batch.slot_mapping[:num_tokens].to(torch.int64)
        k_rows = self._rows(slots // bs, slots % bs).reshape(-1)
        write_rows = torch.stack([k_rows, k_rows + v_shift])

        block_table = batch.block_table.to(torch.int64)
        window = self.spec.sliding_window
        # First key each sequence needs: a window drops keys older than the first query's reach.
        first_query_pos = seq_lens - query_lens
        kv_start = torch.zeros_like(seq_lens)
        if window is not None:
            kv_start = (first_query_pos - window + 1).clamp(min=0)
        kv_lens = seq_lens - kv_start

        is_decode = query_lens == 1
        decode_idx = torch.nonzero(is_decode).flatten()
        num_decodes = int(decode_idx.numel())
        decode_token_idx = decode_rows = decode_mask = None
        decode_kv_len = 0
        decodes_first = False
        if num_decodes:
            decode_token_idx = qsl[decode_idx]
            decodes_first = bool(torch.equal(decode_token_idx, torch.arange(num_decodes)))
            d_start = kv_start[decode_idx]
            d_len = kv_lens[decode_idx]
            decode_kv_len = int(d_len.max())
            j = torch.arange(decode_kv_len, dtype=torch.int64)
            valid = j < d_len.unsqueeze(1)  # [num_decodes, kv_len]
            # Padding positions re-read the sequence's first key (always written, so
            # finite); the -inf mask gives them zero weight.
            pos = d_start.unsqueeze(1) + torch.where(valid, j, 0)
            blocks = torch.gather(block_table[decode_idx], 1, pos // bs)
            rows = self._rows(blocks, pos % bs).permute(0, 2, 1)  # [num_decodes, kv_heads, kv_len]
            decode_rows = torch.stack([rows, rows + v_shift]).reshape(-1)
            decode_mask = torch.zeros(num_decodes, 1, 1, decode_kv_len, dtype=torch.float32)
            decode_mask.masked_fill_(~valid.view(num_decodes, 1, 1, decode_kv_len), _NEG_INF)

        prefills = []
        for i in torch.nonzero(~is_decode & (query_lens > 0)).flatten().tolist():
            q0, q1 = int(qsl[i]), int(qsl[i + 1])
            start, kv_len = int(kv_start[i]), int(kv_lens[i])
            pos = torch.arange(start, start + kv_len, dtype=torch.int64)
            blocks = block_table[i, pos // bs]
            rows = self._rows(blocks, pos % bs).t()  # [kv_heads, kv_len]
            kv_rows = torch.stack([rows, rows + v_shift]).reshape(-1)
            qlen = q1 - q0
            q_pos = torch.arange(int(first_query_pos[i]), int(seq_lens[i]), dtype=torch.int64)
            mask = None
            if window is not None or kv_len != qlen or start != 0:
                allowed = pos.unsqueeze(0) <= q_pos.unsqueeze(1)
                if window is not None:
                    allowed &= pos.unsqueeze(0) > q_pos.unsqueeze(1) - window
                mask = allowed
            prefills.append(_PrefillSeq(q0, q1, kv_rows, kv_len, mask))

        return CpuPagedAttentionMetadata(
            num_actual_tokens=num_tokens,
            write_rows=write_rows,
            num_decodes=num_decodes,
            decode_token_idx=decode_token_idx,
            decodes_first=decodes_first,
            decode_rows=decode_rows,
            decode_kv_len=decode_kv_len,
            decode_mask=decode_mask,
            prefills=tuple(prefills),
            encoder_seqs=(),
        )

    # ----- forward ---------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the new K/V into their cache slots, then attend (see the class docstring)."""
        md: CpuPagedAttentionMetadata = metadata  # type: ignore[assignment]
        # out: [num_tokens, num_heads, head_size]
        out = torch.empty_like(q)
        if not self.spec.causal:
            self._encoder(q, k, v, md, out)
            return out
        if kv_cache is None:
            raise ValueError(f"{self.name}: a causal attention layer needs its kv_cache tensor")
        n = md.num_actual_tokens
        d = self.head_size
        # table: [num_blocks * 2 * num_kv_heads * block_size, head_size]
        table = kv_cache.view(-1, d)
        table.index_copy_(0, md.write_rows[0], k[:n].reshape(-1, d))
        table.index_copy_(0, md.write_rows[1], v[:n].reshape(-1, d))

        if md.num_decodes:
            self._decode(q, table, md, out)
        for p in md.prefills:
            self._prefill(q, table, p, out)
        return out

    def _decode(self, q: torch.Tensor, table: torch.Tensor, md: CpuPagedAttentionMetadata, out: torch.Tensor) -> None:
        nd, hkv, g, d, kvl = md.num_decodes, self.num_kv_heads, self.gqa_ratio, self.head_size, md.decode_kv_len
        # kv: [2, num_decodes, num_kv_heads, kv_len, head_size], each block read once
        kv = table.index_select(0, md.decode_rows).view(2, nd, hkv, kvl, d)
        qd = q[:nd] if md.decodes_first else q.index_select(0, md.decode_token_idx)
        # qd: [num_decodes, num_kv_heads, gqa_ratio, head_size]: query heads grouped per KV head
        qd = qd.reshape(nd, hkv, g, d).float()
        keys = kv[0].float()
        values = kv[1].float()
        # scores: [num_decodes, num_kv_heads, gqa_ratio, kv_len]
        scores = torch.matmul(qd, keys.transpose(-1, -2))
        scores.mul_(self.spec.scale)
        self._soft_cap(scores)
        scores.add_(md.decode_mask)
        probs = torch.softmax(scores, dim=-1)
        res = torch.matmul(probs, values).view(nd, self.num_heads, d)
        if md.decodes_first:
            out[:nd] = res
        else:
            out.index_copy_(0, md.decode_token_idx, res.to(out.dtype))

    def _prefill(self, q: torch.Tensor, table: torch.Tensor, p: _PrefillSeq, out: torch.Tensor) -> None:
        hkv, d = self.num_kv_heads, self.head_size
        kv = table.index_select(0, p.kv_rows).view(2, 1, hkv, p.kv_len, d)
        # qp: [1, num_heads, query_len, head_size]
        qp = q[p.query_start : p.query_end].transpose(0, 1).unsqueeze(0)
        res = self._sdpa(qp, kv[0], kv[1], p.mask, causal=p.mask is None)
        out[p.query_start : p.query_end] = res[0].transpose(0, 1)

    def _encoder(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: CpuPagedAttentionMetadata, out: torch.Tensor) -> None:
        for start, end in md.encoder_seqs:
            qs = q[start:end].transpose(0, 1).unsqueeze(0)
            ks = k[start:end].transpose(0, 1).unsqueeze(0)
            vs = v[start:end].transpose(0, 1).unsqueeze(0)
            res = self._sdpa(qs, ks, vs, None, causal=False)
            out[start:end] = res[0].transpose(0, 1)

    def _sdpa(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        """Attention of q [B, H, Lq, D] over k/v [B, Hkv, L, D]; mask [Lq, L] bool or None."""
        if self.spec.logits_soft_cap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.spec.scale, enable_gqa=self.gqa_ratio > 1
            )
        # SDPA has no soft cap: explicit float32 path, query heads grouped per KV head.
        b, h, lq, d = q.shape
        hkv, kvl = k.shape[1], k.shape[2]
        qg = q.reshape(b, hkv, self.gqa_ratio * lq, d).float()
        scores = torch.matmul(qg, k.float().transpose(-1, -2)).mul_(self.spec.scale)
        self._soft_cap(scores)
        scores = scores.view(b, hkv, self.gqa_ratio, lq, kvl)
        if causal:
            mask = torch.ones(lq, kvl, dtype=torch.bool).tril(kvl - lq)
        if mask is not None:
            scores = scores.masked_fill(~mask, _NEG_INF)
        probs = torch.softmax(scores, dim=-1).view(b, hkv, self.gqa_ratio * lq, kvl)
        return torch.matmul(probs, v.float()).view(b, h, lq, d).to(q.dtype)

    def _soft_cap(self, scores: torch.Tensor) -> None:
        cap = self.spec.logits_soft_cap
        if cap is not None:
            scores.div_(cap).tanh_().mul_(cap)
