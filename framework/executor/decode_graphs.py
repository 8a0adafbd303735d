"""Decode graphs: pure-decode steps replayed from graphs the platform records
(`Platform.graph_capture`: CUDA graphs on CUDA/ROCm, recorded C kernel calls on the CPU),
for the compile backend the plan
names when the platform declares a recorder for it (`compile.build_forward` chooses).

A pure-decode step (every sequence adds one token) is padded to a batch-size bucket
(`decode_buckets`) with static shapes, so each bucket has one graph. Unlike
torch.compile's graphs, these capture attention too: its metadata is built for the padded
batch, and each new step's metadata is copied into the captured tensors before a replay
(`same_structure` decides whether it can be). Every other step runs eagerly.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from portaserve.framework.interfaces import AttentionBatch
from portaserve.framework.interfaces.graph_capture import CapturedGraph, GraphCapture, GraphCaptureUnsupported
from portaserve.framework.layer_context import StepContext

from .compile import EagerForward

logger = logging.getLogger("portaserve")


def decode_buckets(max_num_seqs: int, largest: int = 256) -> tuple[int, ...]:
    """Batch sizes a decode graph is captured for: 1, 2, 4, then every multiple of 8, up to
    min(max_num_seqs, largest), which is always included."""
    top = max(1, min(max_num_seqs, largest))
    sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}
    return tuple(sorted(sizes))


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `num_seqs` sequences, None past the largest."""
    return next((b for b in buckets if b >= num_seqs), None)


def is_pure_decode(batch: AttentionBatch) -> bool:
    """Every sequence adds exactly one token (what a decode graph was captured for)."""
    return batch.max_query_len == 1 and batch.num_actual_tokens == batch.num_seqs


def pad_decode_batch(
    batch: AttentionBatch, bucket: int, *, pad_slot: int, max_blocks_per_seq: int, max_seq_len: int
) -> AttentionBatch:
    """The decode `batch` padded to `bucket` sequences with static shapes.

    Padding sequences have one token at position 0 whose K/V go to `pad_slot` (a slot no
    request owns) and whose block table row is zeros; the block table is widened to
    `max_blocks_per_seq` columns and `max_seq_len` is fixed, so every step of a bucket
    builds metadata of the same shapes and the same work split.
    """
    n = batch.num_seqs
    if not is_pure_decode(batch) or bucket < n:
        raise ValueError(f"pad_decode_batch: need a pure decode batch of at most {bucket} sequences")
    width = batch.block_table.shape[1]
    if width > max_blocks_per_seq:
        raise ValueError(f"block table has {width} columns, more than max_blocks_per_seq {max_blocks_per_seq}")
    block_table = torch.zeros((bucket, max_blocks_per_seq), dtype=batch.block_table.dtype)
    block_table[:n, :width] = batch.block_table
    seq_lens = torch.ones(bucket, dtype=batch.seq_lens.dtype)
    seq_lens[:n] = batch.seq_lens
    slot_mapping = torch.full((bucket,), pad_slot, dtype=batch.slot_mapping.dtype)
    slot_mapping[:n] = batch.slot_mapping[:n]
    return AttentionBatch(
        query_start_loc=torch.arange(bucket + 1, dtype=batch.query_start_loc.dtype),
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        max_query_len=1,
        max_seq_len=max_seq_len,
        block_size=batch.block_size,
        num_actual_tokens=bucket,
    )


def pad_tokens(t: torch.Tensor, size: int) -> torch.Tensor:
    """t: [n] -> [size], zeros appended."""
    out = torch.zeros(size, dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


def same_structure(a: Any, b: Any) -> bool:
    """Whether metadata `b` can be copied into `a`: same types, equal non-tensor values,
    tensors of the same shape, dtype and device."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
    if type(a) is not type(b):
        return False
    if dataclasses.is_dataclass(a):
        return all(same_structure(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_structure(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_structure(a[k], b[k]) for k in a)
    return a == b


def copy_tensors(dst: Any, src: Any) -> None:
    """Copy every tensor of `src` into the matching tensor of `dst` (structures checked before)."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src, non_blocking=True)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            copy_tensors(getattr(dst, f.name), getattr(src, f.name))
    elif isinstance(dst, (tuple, list)):
        for x, y in zip(dst, src):
            copy_tensors(x, y)
    elif isinstance(dst, dict):
        for k in dst:
            copy_tensors(dst[k], src[k])


@dataclasses.dataclass
class _CapturedDecode:
    graph: CapturedGraph | None
    input_ids: torch.Tensor  # [bucket] static
    positions: torch.Tensor  # [bucket] static
    step: StepContext  # its metadata tensors are the graph's static inputs
    output: torch.Tensor  # [bucket, hidden] static


class DecodeGraphForward(EagerForward):
    """Decode steps replayed from per-bucket graphs (recorded by the platform's
    `GraphCapture`); everything else eager.

    `prepare` pads a pure decode step of at most the largest bucket's sequences (see
    `pad_decode_batch`); the first step of each bucket runs eagerly (warming up kernels)
    and is then captured; later ones copy their inputs and metadata into the captured
    tensors and replay. Padding tokens write their K/V into one reserved block past the
    scheduler's (`num_reserved_blocks`).
    """

    num_reserved_blocks = 1

    def __init__(
        self,
        model: nn.Module,
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        graphs: GraphCapture,
        buckets: Sequence[int] | None = None,
    ) -> None:
        super().__init__(model)
        if buckets is None:
            buckets = graphs.batch_sizes or decode_buckets(max_num_seqs)
        self.buckets = tuple(sorted(b for b in buckets if b <= max_num_seqs)) or (1,)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.graphs = graphs
        self.captured: dict[int, _CapturedDecode] = {}
        self.unsupported: set[int] = set()  # buckets the recorder refused (GraphCaptureUnsupported)
        self.unsupported_reason: str | None = None
        self.pad_slot: int | None = None  # set by the runner once the KV cache exists
        self._bucket: int | None = None  # the bucket `prepare` padded the current step to
        self.num_replays = 0
        self.description = (
            f"decode batches of {self.buckets[0]}..{self.buckets[-1]} sequences replayed from graphs "
            f"recorded by {type(graphs).__name__}"
        )

    def set_num_blocks(self, num_blocks: int) -> None:
        """The padding block is the one after the scheduler's; graphs captured over an older
        cache (or older weights, before a sleep) are dropped."""
        self.pad_slot = num_blocks * self.block_size
        self.captured.clear()
        self.unsupported.clear()

    def prepare(self, batch, input_ids, positions):
        self._bucket = None
        if self.pad_slot is None or not is_pure_decode(batch) or batch.block_table.shape[1] > self.max_blocks_per_seq:
            return batch, input_ids, positions
        bucket = bucket_for(batch.num_seqs, self.buckets)
        if bucket is None:
            return batch, input_ids, positions
        self._bucket = bucket
        padded = pad_decode_batch(
            batch, bucket, pad_slot=self.pad_slot, max_blocks_per_seq=self.max_blocks_per_seq, max_seq_len=self.max_model_len
        )
        return padded, pad_tokens(input_ids, bucket), pad_tokens(positions, bucket)

    def __call__(self, input_ids, positions, step):
        bucket, self._bucket = self._bucket, None
        if bucket is None or input_ids.shape[0] != bucket:
            return self.model(input_ids, positions, step)
        if bucket in self.unsupported:
            return self.model(input_ids, positions, step)
        entry = self.captured.get(bucket)
        if entry is None:
            out = self.model(input_ids, positions, step)  # the real step, and the warm-up
            static = _CapturedDecode(None, input_ids.clone(), positions.clone(), step, out)
            try:
                static.graph, static.output = self.graphs.capture(
                    lambda: self.model(static.input_ids, static.positions, static.step)
                )
            except GraphCaptureUnsupported as exc:
                # work the platform's recorder cannot replay, or memory it will not spend:
                # no larger batch would do better, so from this size on decodes run eagerly
                logger.info("decode graphs: %s; decode steps of %d+ sequences run eagerly", exc, bucket)
                self.unsupported.update(b for b in self.buckets if b >= bucket)
                self.unsupported_reason = str(exc)
                return out
            self.captured[bucket] = static
            return out
        if not same_structure(entry.step.attn_metadata, step.attn_metadata) or entry.step.kv_caches is not step.kv_caches:
            logger.debug("decode graph for %d sequences: metadata changed shape, running eagerly", bucket)
            return self.model(input_ids, positions, step)
        entry.input_ids.copy_(input_ids)
        entry.positions.copy_(positions)
        copy_tensors(entry.step.attn_metadata, step.attn_metadata)
        entry.graph.replay()
        self.num_replays += 1
        return entry.output
