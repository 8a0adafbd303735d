"""nova's paged attention over a vLLM-style KV cache, in plain torch.

KV-cache layout (per layer): ``[2, num_blocks, block_size, num_kv_heads, head_size]``:
the K plane, then the V plane; block ids index dimension 1, which the backend declares
as `kv_cache_block_dim = 1`, so the engine allocates exactly this shape and moves blocks
(offload, sleep) along that dimension. Each plane viewed as ``[num_blocks * block_size,
num_kv_heads, head_size]`` is indexed directly by a token's flat slot ``block *
block_size + offset`` (the `AttentionBatch.slot_mapping` convention): one `index_copy_`
writes a step's new K (or V), one `index_select` reads a sequence's context.

Ordering contract: `forward` first writes the new K/V of every real token (never the
padding past `num_actual_tokens`), then attends each sequence over its context read back
from the cache, so a sequence may read blocks another one writes in the same step.
Masks: causal with the cached prefix's offset; with a sliding window W a query at
position p sees keys in (p - W, p]. Softmax in float32 for every dtype. Encoders (no KV
cache) are not supported, and the backend says so in its capabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portaserve.framework.interfaces import AttentionBackend, AttentionBatch, AttentionMetadata

from .platform import NOVA_BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class _Sequence:
    query_start: int
    query_len: int
    # slots: [kv_len] int64 flat slots of the keys this sequence attends to
    slots: torch.Tensor
    # mask: [query_len, kv_len] bool (True = attend)
    mask: torch.Tensor


@dataclass(frozen=True, slots=True)
class NovaAttentionMetadata(AttentionMetadata):
    # write_slots: [num_actual_tokens] int64 flat slots of the new tokens
    write_slots: torch.Tensor
    sequences: tuple[_Sequence, ...]


class NovaPagedAttentionBackend(AttentionBackend):
    """Paged attention for nova: K and V planes, blocks of 32 tokens."""

    name = "nova_paged"
    metadata_type = NovaAttentionMetadata
    platforms = frozenset({"nova"})
    supported_dtypes = frozenset({torch.float32, torch.bfloat16, torch.float16})
    supported_kv_cache_dtypes = frozenset({"auto"})
    supported_head_sizes = frozenset({32, 64, 128})
    supported_block_sizes = frozenset({NOVA_BLOCK_SIZE})
    supports_sliding_window = True
    supports_encoder = False
    #: [2, num_blocks, ...]: block ids index dimension 1
    kv_cache_block_dim = 1

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K plane, V plane)."""
        return (2, num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_size)

    def build_metadata(self, batch: AttentionBatch) -> NovaAttentionMetadata:
        spec, bs = self.spec, self.block_size
        qsl = batch.query_start_loc.tolist()
        seq_lens = batch.seq_lens.tolist()
        block_table = batch.block_table.to(torch.int64)
        sequences = []
        for i in range(batch.num_seqs):
            start, query_len = qsl[i], qsl[i + 1] - qsl[i]
            if query_len == 0:
                continue
            seq_len = seq_lens[i]
            first_query = seq_len - query_len
            window = spec.sliding_window
            kv_start = 0 if window is None else max(0, first_query - window + 1)
            key_pos = torch.arange(kv_start, seq_len, dtype=torch.int64)
            slots = block_table[i, key_pos // bs] * bs + key_pos % bs
            query_pos = torch.arange(first_query, seq_len, dtype=torch.int64).unsqueeze(1)
            mask = key_pos.unsqueeze(0) <= query_pos
            if window is not None:
                mask &= key_pos.unsqueeze(0) > query_pos - window
            sequences.append(_Sequence(start, query_len, slots.to(self.device), mask.to(self.device)))
        write_slots = batch.slot_mapping[: batch.num_actual_tokens].to(torch.int64).to(self.device)
        return NovaAttentionMetadata(batch.num_actual_tokens, write_slots, tuple(sequences))

    def _planes(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V planes as ``[num_blocks * block_size, num_kv_heads, head_size]`` views."""
        hkv, d = self.spec.num_kv_heads, self.spec.head_size
        return kv_cache[0].view(-1, hkv, d), kv_cache[1].view(-1, hkv, d)

    def _forward(self, q, k, v, kv_cache, metadata: NovaAttentionMetadata) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size]
        k_plane, v_plane = self._planes(kv_cache)
        n = metadata.num_actual_tokens
        k_plane.index_copy_(0, metadata.write_slots, k[:n].to(kv_cache.dtype))
        v_plane.index_copy_(0, metadata.write_slots, v[:n].to(kv_cache.dtype))
        out = torch.zeros_like(q)
        for seq in metadata.sequences:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            keys = k_plane.index_select(0, seq.slots)
            values = v_plane.index_select(0, seq.slots)
            out[rows] = self._attend(q[rows], keys, values, seq.mask)
        return out

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q: [query_len, num_heads, d]; keys, values: [kv_len, num_kv_heads, d] -> [query_len, num_heads, d]."""
        spec = self.spec
        ratio = spec.num_heads // spec.num_kv_heads
        query_len = q.shape[0]
        # group the query heads of each KV head: no K/V repeat for GQA
        qf = q.float().reshape(query_len, spec.num_kv_heads, ratio, spec.head_size).permute(1, 2, 0, 3)
        qf = qf.reshape(spec.num_kv_heads, ratio * query_len, spec.head_size)  # [kv_heads, ratio * qlen, d]
        kf = keys.float().transpose(0, 1)  # [kv_heads, kv_len, d]
        vf = values.float().transpose(0, 1)
        scores = (qf @ kf.transpose(1, 2)) * spec.scale  # [kv_heads, ratio * qlen, kv_len]
        if spec.logits_soft_cap is not None:
            scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
        scores = scores.masked_fill(~mask.repeat(ratio, 1), float("-inf"))
        out = torch.softmax(scores, dim=-1) @ vf  # [kv_heads, ratio * qlen, d]
        out = out.reshape(spec.num_kv_heads, ratio, query_len, spec.head_size).permute(2, 0, 1, 3)
        return out.reshape(query_len, spec.num_heads, spec.head_size).to(q.dtype)
