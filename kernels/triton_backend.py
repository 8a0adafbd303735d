"""TritonAttentionBackend: paged attention through the Triton kernels of this package.

Triton compiles the same kernels for CUDA, ROCm and XPU; on CPU they run through the
Triton interpreter (`TRITON_INTERPRET=1`), which is how CI tests them — selectable
there only for testing (`--attention-backend triton`, the CPU platform declaring the
"triton" feature under the interpreter).

KV-cache layout: `kernels.kv_layout` (`[num_blocks, 2, num_kv_heads, block_size,
head_size]`, block ids on dim 0). With `kv_cache_dtype="fp8"` the cache holds e4m3 values
of K / k_scale and V / v_scale (scales 1.0 unless set, as vLLM without calibrated
scales): the new K/V are quantized in torch and their bytes copied into the slots (one
rounding, the same on every device), the kernel widens the pages it reads to q's dtype,
and the scales fold into the softmax scale (K) and the output (V).

Encoder layers (`spec.causal` False: BERT, vision towers) keep no cache; each sequence
attends to itself in full through torch's `scaled_dot_product_attention` (the vendor's
fused kernel where torch has one), one call per run of equal-length sequences. This module imports no triton at import time: the
plan imports every registered backend class to read its capabilities, also on machines
where triton is absent; the kernels are imported when a backend is instantiated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from portaserve.framework import device_properties
from portaserve.framework.interfaces import AttentionBackend, AttentionBatch, AttentionMetadata, AttentionSpec

if TYPE_CHECKING:
    from .paged_attention import AttentionWork

#: Programs per compute unit that keep a GPU busy; below that, decode splits its context.
PROGRAMS_PER_UNIT = 2
#: Where the platform published no compute units (the interpreter has none): a small
#: target, which still exercises split-K there.
INTERPRETER_TARGET_PROGRAMS = 8


@dataclass(frozen=True, slots=True)
class TritonAttentionMetadata(AttentionMetadata):
    """One step's device tensors and work split, shared by every layer of a layer type."""

    # query_start_loc: [num_seqs + 1] int32 on the device
    query_start_loc: torch.Tensor
    # seq_lens: [num_seqs] int32
    seq_lens: torch.Tensor
    # block_table: [num_seqs, max_blocks_per_seq] int32
    block_table: torch.Tensor
    # slot_mapping: [num_tokens] int64 (only the first num_actual_tokens are written)
    slot_mapping: torch.Tensor
    work: "AttentionWork | None"
    #: encoder layers: (start, length, count) runs of equal-length sequences; () otherwise
    encoder_runs: tuple[tuple[int, int, int], ...] = ()


def target_programs(device: torch.device) -> int:
    """Programs that fill `device`: about two per compute unit (SM / CU / Xe-core), as its
    platform reports them (`Platform.compute_units`, published by the worker)."""
    units = device_properties.compute_units(device)
    if not units:
        return INTERPRETER_TARGET_PROGRAMS
    return PROGRAMS_PER_UNIT * units


def _new_output(q: torch.Tensor) -> torch.Tensor:
    """The attention output buffer (a seam: tests poison it with NaN)."""
    return torch.empty_like(q)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonAttentionBackend(AttentionBackend):
    """Causal paged attention for decoder layers: mixed prefill/decode batches in one
    kernel (split-K for long contexts), GQA, sliding window, logit soft cap.

    `forward` first writes the new K/V of every real token into their slots
    (`reshape_and_cache`), then attends, reading every context token — the new ones
    included — from the cache. A query at position p attends to keys in (p - W, p] with
    a sliding window W. Softmax runs in float32 for every dtype.
    """

    name = "triton"
    metadata_type = TritonAttentionMetadata
    # Any platform that declares the "triton" feature (a vendor's plugin included; the CPU
    # under the Triton interpreter too): nothing here names a platform.
    platforms = None
    supported_dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    supported_kv_cache_dtypes = frozenset({"auto", "fp8"})
    # padded to a power of two inside the kernels; >= 16, the smallest tl.dot dimension
    supported_head_sizes = frozenset({16, 32, 64, 80, 96, 112, 128, 192, 256})
    supported_block_sizes = frozenset({16, 32, 64})
    supports_sliding_window = True
    supports_encoder = True
    # query heads of one KV head share a program's rows; 16 keeps a decode tile at 16 rows
    max_gqa_ratio = 16
    required_features = frozenset({"triton"})

    def __init__(self, spec: AttentionSpec, block_size: int, device: torch.device) -> None:
        super().__init__(spec, block_size, device)
        from . import paged_attention, reshape_and_cache

        self._kernels = paged_attention
        self._write = reshape_and_cache.reshape_and_cache
        self._target_programs = target_programs(torch.device(device))
        #: fp8 caches store K / k_scale and V / v_scale
        self.k_scale = 1.0
        self.v_scale = 1.0

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """`[num_blocks, 2, num_kv_heads, block_size, head_size]` (K = 0, V = 1 on dim 1)."""
        from .kv_layout import kv_cache_shape

        return kv_cache_shape(num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_size)

    def build_metadata(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        """Cut the step into kernel work items on the host and move the tables to the device."""
        qsl = batch.query_start_loc.cpu()
        query_lens = (qsl[1:] - qsl[:-1]).numpy()
        if not self.spec.causal:
            return TritonAttentionMetadata(
                num_actual_tokens=batch.num_actual_tokens, query_start_loc=batch.query_start_loc,
                seq_lens=batch.seq_lens, block_table=batch.block_table, slot_mapping=batch.slot_mapping, work=None,
                encoder_runs=_equal_length_runs(query_lens.tolist()),
            )
        work = self._kernels.plan_work(
            query_lens,
            batch.max_seq_len,
            self.spec.num_kv_heads,
            self.spec.gqa_ratio,
            self.spec.head_size,
            self.device,
            target_programs=self._target_programs,
        )

        def dev(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return t.to(device=self.device, dtype=dtype, non_blocking=True).contiguous()

        return TritonAttentionMetadata(
            num_actual_tokens=batch.num_actual_tokens,
            query_start_loc=dev(batch.query_start_loc, torch.int32),
            seq_lens=dev(batch.seq_lens, torch.int32),
            block_table=dev(batch.block_table, torch.int32),
            slot_mapping=dev(batch.slot_mapping, torch.int64),
            work=work,
        )

    def _forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the new K/V into their cache slots, then attend (see the class docstring).

        :param q: [num_tokens, num_heads, head_size]
        :param k: [num_tokens, num_kv_heads, head_size]
        :param v: [num_tokens, num_kv_heads, head_size]
        :param kv_cache: [num_blocks, 2, num_kv_heads, block_size, head_size]
        :returns: [num_tokens, num_heads, head_size]; rows past num_actual_tokens are unspecified.
        """
        if not self.spec.causal:
            return self._encoder_forward(q, k, v, metadata)
        q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
        fp8 = kv_cache.dtype.itemsize == 1
        if fp8:
            # k8, v8: [num_tokens, num_kv_heads, head_size] as raw bytes, copied as they are
            k8, v8 = _to_fp8(k, self.k_scale, kv_cache.dtype), _to_fp8(v, self.v_scale, kv_cache.dtype)
            self._write(k8, v8, kv_cache.view(torch.uint8), metadata.slot_mapping, num_tokens=metadata.num_actual_tokens)
        else:
            self._write(k, v, kv_cache, metadata.slot_mapping, num_tokens=metadata.num_actual_tokens)
        out = _new_output(q)
        spec = self.spec
        self._kernels.paged_attention(
            q,
            kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.work,
            spec.scale * self.k_scale if fp8 else spec.scale,
            sliding_window=spec.sliding_window,
            soft_cap=spec.logits_soft_cap,
            out=out,
        )
        if fp8 and self.v_scale != 1.0:
            out.mul_(self.v_scale)
        return out


    def _encoder_forward(self, q, k, v, metadata) -> torch.Tensor:
        """Bidirectional attention within each sequence, in runs of equal lengths:
        q: [num_tokens, num_heads, head_size], k/v: [num_tokens, num_kv_heads, head_size]."""
        import torch.nn.functional as F

        out = torch.empty_like(q)
        ratio = self.spec.gqa_ratio
        for start, length, count in metadata.encoder_runs:
            end = start + length * count

            def heads_first(x, repeat=1):
                # [count * length, heads, d] -> [count, heads * repeat, length, d]
                x = x[start:end].reshape(count, length, x.shape[1], x.shape[2]).transpose(1, 2)
                return x.repeat_interleave(repeat, dim=1) if repeat > 1 else x

            o = F.scaled_dot_product_attention(heads_first(q), heads_first(k, ratio), heads_first(v, ratio),
                                               scale=self.spec.scale)
            out[start:end] = o.transpose(1, 2).reshape(end - start, q.shape[1], q.shape[2])
        return out


def _equal_length_runs(lengths: list[int]) -> tuple[tuple[int, int, int], ...]:
    """(first token, length, number of sequences) of each run of consecutive equal lengths."""
    runs: list[list[int]] = []
    start = 0
    for n in lengths:
        if runs and runs[-1][1] == n:
            runs[-1][2] += 1
        elif n:
            runs.append([start, n, 1])
        start += n
    return tuple(tuple(r) for r in runs)


def _to_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale saturated to fp8's range, as uint8 bytes of `dtype`."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype).view(torch.uint8)
