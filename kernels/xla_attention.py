"""XlaPagedAttentionBackend: paged attention for TPUs in plain torch ops XLA compiles.

Every tensor of a step has a shape taken from `kernels.xla_buckets` (padded sequences,
query rows per sequence and blocks per sequence; the model runner pads tokens), and the
step itself has no data-dependent shapes: K/V of each sequence are gathered by block
table into a padded dense tensor, queries are scattered into a padded
`[num_seqs, max_query_len]` grid, attention is a masked dense softmax, and the result is
gathered back into token order. Everything data-dependent (which token belongs where) is
computed on the host in `build_metadata` and arrives as index tensors.

The math is `dense_paged_attention`, a function of plain tensors, so CPU tests check it
against the float64 reference without torch_xla; the module imports no torch_xla (lazy
tensors trace these ops as they are). A Pallas ragged-paged-attention kernel would be
the faster path on TPU; this one is portable and exact.

KV-cache layout per layer: `[num_blocks, block_size, 2, num_kv_heads, head_size]`, so
the cache viewed as `[num_blocks * block_size, 2, ...]` is indexed by slot directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from portaserve.framework.interfaces import AttentionBackend, AttentionBatch, AttentionMetadata, AttentionSpec

from .xla_buckets import Buckets, StepBuckets

#: Limits of the default buckets (a runner with other limits sets `backend.buckets`).
DEFAULT_LIMITS = dict(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=32768)


@dataclass(frozen=True, slots=True)
class XlaAttentionMetadata(AttentionMetadata):
    """One step's index tensors; every shape is a bucket size (or the runner's token count)."""

    # block_table: [num_seqs_pad, blocks_pad] int64, padded with block 0 (masked by seq_lens)
    block_table: torch.Tensor
    # seq_lens: [num_seqs_pad] int64, 0 for padding sequences
    seq_lens: torch.Tensor
    # query_lens: [num_seqs_pad] int64, 0 for padding sequences
    query_lens: torch.Tensor
    # dense_rows: [num_tokens] int64, row of each token in the [num_seqs_pad * query_pad] grid;
    # padding tokens point one past the grid (a scratch row)
    dense_rows: torch.Tensor
    # write_src: [num_tokens] int64, the token whose K/V each row writes: itself, or token 0
    # for padding rows, which then rewrite token 0's slot with token 0's values (harmless)
    write_src: torch.Tensor
    # slot_mapping: [num_tokens] int64
    slot_mapping: torch.Tensor
    query_pad: int
    #: False for a step without real tokens (then no row may write, not even token 0)
    write: bool


def dense_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    dense_rows: torch.Tensor,
    query_pad: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of every token over its sequence's paged context, with static shapes.

    :param q: [num_tokens, num_heads, head_size]
    :param kv_cache: [num_blocks, block_size, 2, num_kv_heads, head_size], new K/V written
    :param block_table: [num_seqs, blocks] int64
    :param seq_lens: [num_seqs] int64 (context incl. new tokens; 0 = padding sequence)
    :param query_lens: [num_seqs] int64
    :param dense_rows: [num_tokens] int64 in [0, num_seqs * query_pad] (the last = scratch)
    :param query_pad: query rows per sequence in the dense grid
    :returns: [num_tokens, num_heads, head_size] in q's dtype; padding tokens get zeros.
    """
    num_tokens, num_heads, head_size = q.shape
    block_size, num_kv_heads = kv_cache.shape[1], kv_cache.shape[3]
    num_seqs, num_blocks = block_table.shape
    gqa = num_heads // num_kv_heads
    context = num_blocks * block_size

    # q_grid: [num_seqs, query_pad, num_kv_heads, gqa, head_size]
    grid_rows = num_seqs * query_pad
    q_grid = q.new_zeros((grid_rows + 1, num_heads, head_size)).index_copy(0, dense_rows, q)
    q_grid = q_grid[:grid_rows].view(num_seqs, query_pad, num_kv_heads, gqa, head_size)
    # kv: [num_seqs, context, 2, num_kv_heads, head_size]
    kv = kv_cache.index_select(0, block_table.reshape(-1)).view(num_seqs, context, 2, num_kv_heads, head_size)
    k, v = kv[:, :, 0], kv[:, :, 1]
    key = torch.arange(context, device=q.device)
    # Slots past a context (the rest of a last block, padding blocks) hold whatever the
    # cache held; zeroing them keeps 0-weight keys from turning into NaN * 0.
    in_context = (key.view(1, context) < seq_lens.view(num_seqs, 1)).view(num_seqs, context, 1, 1)
    v = v.masked_fill(~in_context, 0)

    # scores: [num_seqs, num_kv_heads, gqa, query_pad, context], float32 for every dtype
    scores = torch.einsum("sqhgd,skhd->shgqk", q_grid.float(), k.float()) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    first_pos = (seq_lens - query_lens).view(num_seqs, 1, 1)
    q_idx = torch.arange(query_pad, device=q.device).view(1, query_pad, 1)
    key = key.view(1, 1, context)
    pos = first_pos + q_idx
    visible = (key <= pos) & (q_idx < query_lens.view(num_seqs, 1, 1))
    if sliding_window is not None:
        visible = visible & (pos - key < sliding_window)
    # a finite floor: padding rows (nothing visible) come out uniform, never NaN
    scores = scores.masked_fill(~visible.view(num_seqs, 1, 1, query_pad, context), torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("shgqk,skhd->sqhgd", probs, v.float()).to(q.dtype)
    out = out.reshape(grid_rows, num_heads, head_size)
    out = torch.cat([out, out.new_zeros((1, num_heads, head_size))])
    return out.index_select(0, dense_rows)


class XlaPagedAttentionBackend(AttentionBackend):
    """Causal paged attention in static-shape torch ops for TPUs (torch_xla traces them).

    Ordering contract: `forward` writes the new K/V of every real token into its slot,
    then attends over the cache. A query at position p attends to keys in (p - W, p]
    with a sliding window W. Softmax in float32.
    """

    name = "xla_paged"
    metadata_type = XlaAttentionMetadata
    platforms = frozenset({"tpu"})
    # bf16 is what TPU MXUs multiply; fp16 is emulated there (the TPU platform excludes it)
    supported_dtypes = frozenset({torch.bfloat16, torch.float32})
    supported_kv_cache_dtypes = frozenset({"auto"})
    supported_head_sizes = None
    supported_block_sizes = frozenset({16, 32, 64, 128})
    supports_sliding_window = True
    supports_encoder = False
    max_gqa_ratio = None
    required_features = frozenset({"xla"})

    def __init__(self, spec: AttentionSpec, block_size: int, device: torch.device) -> None:
        super().__init__(spec, block_size, device)
        #: Sequence, query-length and block buckets (the runner may replace them with its limits).
        self.buckets: StepBuckets = StepBuckets.for_limits(block_size=block_size, **DEFAULT_LIMITS)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """`[num_blocks, block_size, 2, num_kv_heads, head_size]` (K = 0, V = 1 on dim 2)."""
        return (num_blocks, self.block_size, 2, self.spec.num_kv_heads, self.spec.head_size)

    def build_metadata(self, batch: AttentionBatch) -> XlaAttentionMetadata:
        """Pad sequences, query rows and blocks to their buckets; index tensors on the host."""
        qsl = batch.query_start_loc.cpu().numpy().astype(np.int64)
        query_lens = qsl[1:] - qsl[:-1]
        seq_lens = batch.seq_lens.cpu().numpy().astype(np.int64)
        num_seqs = query_lens.size
        num_tokens = batch.slot_mapping.shape[0]
        blocks_needed = int((-(-seq_lens // self.block_size)).max()) if num_seqs else 1
        seqs_pad = self.buckets.seqs.pad(num_seqs)
        query_pad = self.buckets.query_lens.pad(max(int(query_lens.max()) if num_seqs else 1, 1))
        blocks_pad = self.buckets.blocks.pad(max(blocks_needed, 1))

        table = np.zeros((seqs_pad, blocks_pad), dtype=np.int64)
        width = min(batch.block_table.shape[1], blocks_pad)
        table[:num_seqs, :width] = batch.block_table[:, :width].cpu().numpy()
        padded_seq_lens = np.zeros(seqs_pad, dtype=np.int64)
        padded_seq_lens[:num_seqs] = seq_lens
        padded_query_lens = np.zeros(seqs_pad, dtype=np.int64)
        padded_query_lens[:num_seqs] = query_lens

        real = batch.num_actual_tokens
        scratch = seqs_pad * query_pad
        dense_rows = np.full(num_tokens, scratch, dtype=np.int64)
        seq_of_token = np.repeat(np.arange(num_seqs, dtype=np.int64), query_lens)
        dense_rows[:real] = seq_of_token * query_pad + (np.arange(real) - qsl[seq_of_token])
        write_src = np.zeros(num_tokens, dtype=np.int64)
        write_src[:real] = np.arange(real)

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(self.device)

        return XlaAttentionMetadata(
            num_actual_tokens=real,
            block_table=dev(table),
            seq_lens=dev(padded_seq_lens),
            query_lens=dev(padded_query_lens),
            dense_rows=dev(dense_rows),
            write_src=dev(write_src),
            slot_mapping=batch.slot_mapping.to(device=self.device, dtype=torch.int64),
            query_pad=query_pad,
            write=real > 0,
        )

    def _forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the new K/V into their slots, then attend (see the class docstring).

        :param q: [num_tokens, num_heads, head_size]
        :param k: [num_tokens, num_kv_heads, head_size]
        :param v: [num_tokens, num_kv_heads, head_size]
        :param kv_cache: [num_blocks, block_size, 2, num_kv_heads, head_size]
        :returns: [num_tokens, num_heads, head_size]; rows past num_actual_tokens are zeros.
        """
        spec = self.spec
        # Static-shape write: padding rows duplicate token 0's (slot, value) pair, so the
        # scatter has no conflicting duplicates and no data-dependent length.
        if metadata.write:
            src = metadata.write_src
            new_kv = torch.stack([k, v], dim=1).index_select(0, src).to(kv_cache.dtype)
            slots = metadata.slot_mapping.index_select(0, src)
            flat = kv_cache.view(-1, 2, spec.num_kv_heads, spec.head_size)
            flat.index_copy_(0, slots, new_kv)
        return dense_paged_attention(
            q,
            kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_lens,
            metadata.dense_rows,
            metadata.query_pad,
            spec.scale,
            sliding_window=spec.sliding_window,
            soft_cap=spec.logits_soft_cap,
        )


__all__ = ["Buckets", "StepBuckets", "XlaAttentionMetadata", "XlaPagedAttentionBackend", "dense_paged_attention"]
