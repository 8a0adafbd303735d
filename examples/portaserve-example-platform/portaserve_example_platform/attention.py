"""The example device's paged attention: plain torch, written against the interface only.

KV-cache layout (per layer), block-major: ``[num_blocks, 2, block_size, num_kv_heads,
head_size]``, K at index 0 and V at index 1 of dim 1; block ids index dim 0, so
`kv_cache_block_dim` keeps the interface's default 0. A token's flat slot
``block * block_size + offset`` (the `AttentionBatch.slot_mapping` convention) is
``cache[block, kv, offset]``.

The algorithm is the simplest correct one, one sequence at a time: a real vendor plugin
would put its kernels here. `build_metadata` turns each sequence's block table into the
slots of its context and a boolean mask (causal with the offset of the cached prefix,
and the sliding window), once per step; `forward` first writes every new token's K/V
into its slot, then attends each sequence over the K/V it reads back from the cache, so
a sequence may read blocks another sequence of the same batch writes in the same step
(prefix sharing relies on it). Scores and softmax are computed in float32 for every dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portaserve.framework.interfaces import AttentionBackend, AttentionBatch, AttentionMetadata


@dataclass(frozen=True, slots=True)
class _Sequence:
    """One sequence's share of a step."""

    query_start: int
    query_len: int
    # slots: [kv_len] int64 flat cache slots of the keys it attends to; None for an encoder
    # input (its keys are its own new tokens, read from k / v directly)
    slots: torch.Tensor | None
    # mask: [query_len, kv_len] bool, True = attend; None = attend to every key
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class ExampleAttentionMetadata(AttentionMetadata):
    # write_slots: [num_actual_tokens] int64 slots of the new tokens; None for encoders
    write_slots: torch.Tensor | None
    sequences: tuple[_Sequence, ...]


class ExamplePagedAttentionBackend(AttentionBackend):
    """Paged attention over a host-memory, block-major KV cache."""

    name = "example_paged"
    metadata_type = ExampleAttentionMetadata
    platforms = frozenset({"example"})
    supported_dtypes = frozenset({torch.float32, torch.bfloat16, torch.float16})
    supported_kv_cache_dtypes = frozenset({"auto"})
    supported_head_sizes = None
    supported_block_sizes = frozenset({8, 16, 32, 64, 128})
    supports_sliding_window = True
    supports_encoder = True
    kv_cache_block_dim = 0

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``[num_blocks, 2, block_size, num_kv_heads, head_size]``."""
        return (num_blocks, 2, self.block_size, self.spec.num_kv_heads, self.spec.head_size)

    def build_metadata(self, batch: AttentionBatch) -> ExampleAttentionMetadata:
        spec, bs = self.spec, self.block_size
        qsl = batch.query_start_loc.tolist()
        seq_lens = batch.seq_lens.tolist()
        block_table = batch.block_table.to(torch.int64)
        sequences = []
        for i in range(batch.num_seqs):
            start, query_len = qsl[i], qsl[i + 1] - qsl[i]
            if query_len == 0:
                continue
            if not spec.causal:
                sequences.append(_Sequence(start, query_len, None, None))
                continue
            seq_len = seq_lens[i]
            first_query = seq_len - query_len  # position of the first new token
            # the oldest key any of the new tokens can see
            kv_start = 0 if spec.sliding_window is None else max(0, first_query - spec.sliding_window + 1)
            key_pos = torch.arange(kv_start, seq_len, dtype=torch.int64)
            slots = block_table[i, key_pos // bs] * bs + key_pos % bs
            query_pos = torch.arange(first_query, seq_len, dtype=torch.int64).unsqueeze(1)
            mask = key_pos.unsqueeze(0) <= query_pos
            if spec.sliding_window is not None:
                mask &= key_pos.unsqueeze(0) > query_pos - spec.sliding_window
            sequences.append(_Sequence(start, query_len, slots.to(self.device), mask.to(self.device)))
        write_slots = None
        if spec.causal:
            write_slots = batch.slot_mapping[: batch.num_actual_tokens].to(torch.int64).to(self.device)
        return ExampleAttentionMetadata(batch.num_actual_tokens, write_slots, tuple(sequences))

    def _forward(self, q, k, v, kv_cache, metadata: ExampleAttentionMetadata) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size]
        out = torch.zeros_like(q)
        if metadata.write_slots is not None:
            # only the real tokens: padding rows past num_actual_tokens must not be written
            n = metadata.num_actual_tokens
            blocks, offsets = metadata.write_slots // self.block_size, metadata.write_slots % self.block_size
            kv_cache[blocks, 0, offsets] = k[:n].to(kv_cache.dtype)
            kv_cache[blocks, 1, offsets] = v[:n].to(kv_cache.dtype)
        for seq in metadata.sequences:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            if seq.slots is None:
                keys, values = k[rows], v[rows]
            else:
                blocks, offsets = seq.slots // self.block_size, seq.slots % self.block_size
                keys, values = kv_cache[blocks, 0, offsets], kv_cache[blocks, 1, offsets]
            out[rows] = self._attend(q[rows], keys, values, seq.mask)
        return out

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q: [query_len, num_heads, d]; keys, values: [kv_len, num_kv_heads, d] -> [query_len, num_heads, d]."""
        spec = self.spec
        ratio = spec.num_heads // spec.num_kv_heads
        # KV head j serves query heads j * ratio ... (j + 1) * ratio - 1
        qf = q.float().transpose(0, 1)  # [heads, query_len, d]
        kf = keys.float().repeat_interleave(ratio, dim=1).transpose(0, 1)  # [heads, kv_len, d]
        vf = values.float().repeat_interleave(ratio, dim=1).transpose(0, 1)
        scores = (qf @ kf.transpose(1, 2)) * spec.scale  # [heads, query_len, kv_len]
        if spec.logits_soft_cap is not None:
            scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ vf).transpose(0, 1).to(q.dtype)
