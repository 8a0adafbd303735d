"""Graph compilation of the model's forward, by the compile backend the ExecutionPlan names.

The plan's `compilation` choice is a mode ("none", "default", "max") and the platform's
`compile_backends` map it to a backend; `build_forward` turns that into the callable the
model runner uses for `model(input_ids, positions, step)`:

- "none" -> `EagerForward`: the model as it is.
- "inductor" (CPU, XPU; CUDA/ROCm "max") -> `TorchCompileForward`: `torch.compile` with
  the token dimension dynamic (one graph for every batch size, plus the size-1 graph
  torch specializes); "max" adds inductor's max-autotune GEMM search. Compiled kernels
  land in inductor's on-disk caches under portaserve's cache folder
  (`compile_cache_dir()`), so a second start with the same model and torch reuses them.
- a backend the platform records graphs for (`Platform.graph_capture` returns a
  recorder: CUDA graphs for CUDA/ROCm "default") -> `DecodeGraphForward`: pure-decode
  steps padded to a batch-size bucket and replayed from a graph captured per bucket;
  every other step runs eagerly.
- any other name (TPU's "openxla") -> `TorchCompileForward` with that dynamo backend.

Attention stays out of the graphs: its metadata is Python objects that change every
step (sequence groups, split counts), which would make dynamo re-specialize without end.
Each attention layer is wrapped (`OpaqueAttention`) so that while compiling it becomes
one call of the custom op `portaserve::attention`, which runs the layer eagerly with the
step's context (set around every compiled call). Decode graphs instead capture attention
too, from metadata built for the padded batch, and copy each new step's metadata into
the captured tensors before a replay (see `DecodeGraphForward`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from portaserve.framework.interfaces import AttentionBackend, AttentionBatch
from portaserve.framework.interfaces.graph_capture import CapturedGraph, GraphCapture
from portaserve.framework.layer_context import StepContext
from portaserve.framework.plan import ExecutionPlan

logger = logging.getLogger("portaserve")

# ----- on-disk caches -------------------------------------------------------------------


def compile_cache_dir() -> Path:
    """Where compiled artifacts live: `<portaserve cache>/compile/inductor`."""
    from portaserve.framework.checkpoint import portaserve_cache_dir

    return portaserve_cache_dir() / "compile" / "inductor"


def configure_compile_cache() -> Path:
    """Point inductor's caches (FX graph, AOTAutograd, generated kernels) at portaserve's
    cache folder unless the user chose one with TORCHINDUCTOR_CACHE_DIR; returns the folder."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    folder = Path(chosen) if chosen else compile_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    return folder


# ----- attention as one opaque op -------------------------------------------------------

#: (step, the model's attention layers) of the compiled call running now
_CONTEXT: list[tuple[StepContext, Sequence[nn.Module]]] = []


@contextlib.contextmanager
def step_context(step: StepContext, layers: Sequence[nn.Module]) -> Iterator[None]:
    """Make `step` and the model's attention `layers` what the opaque op reads (around one
    compiled call). Layers are looked up by their index in the model, so every instance
    of a model (and every process) traces the same graph and shares compiled artifacts."""
    _CONTEXT.append((step, layers))
    try:
        yield
    finally:
        _CONTEXT.pop()


@torch.library.custom_op("portaserve::attention", mutates_args=())
def opaque_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_key: int) -> torch.Tensor:
    """Run the model's attention layer number `layer_key` eagerly on the current step (it
    writes its KV cache).

    :param q: [num_tokens, num_heads, head_size]; k, v: [num_tokens, num_kv_heads, head_size]
    :returns: [num_tokens, num_heads * head_size]
    """
    if not _CONTEXT:
        raise RuntimeError("portaserve::attention called outside step_context()")
    step, layers = _CONTEXT[-1]
    out = layers[layer_key](q, k, v, step)
    # a custom op's output must not alias its inputs
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    return out.clone() if out.untyped_storage().data_ptr() in inputs else out


@opaque_attention.register_fake
def _(q, k, v, layer_key):
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))


class OpaqueAttention(nn.Module):
    """Wraps an attention layer: eager calls go straight to it, compiled ones through the op."""

    def __init__(self, inner: nn.Module, layer_key: int) -> None:
        super().__init__()
        self.inner = inner
        self.layer_key = layer_key  # its index among the model's attention layers

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepContext) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.portaserve.attention(q, k, v, self.layer_key)
        return self.inner(q, k, v, step)


def is_attention_layer(module: nn.Module) -> bool:
    """An attention layer in the models' sense: holds an AttentionBackend and a layer index."""
    return isinstance(getattr(module, "backend", None), AttentionBackend) and hasattr(module, "layer_idx")


def make_attention_opaque(model: nn.Module) -> list[nn.Module]:
    """Wrap every attention layer of `model` in `OpaqueAttention` (in place); returns the
    wrapped layers in order (what `step_context` takes)."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        if not isinstance(parent, OpaqueAttention)
        for name, child in parent.named_children()
        if is_attention_layer(child)
    ]
    for key, (parent, name, child) in enumerate(targets):
        setattr(parent, name, OpaqueAttention(child, key))
    return [child for _parent, _name, child in targets]


# ----- forwards ---------------------------------------------------------------------------


class EagerForward:
    """`model(input_ids, positions, step)`, no compilation (and the base of the others)."""

    #: KV-cache blocks the forward needs beyond the scheduler's (decode graphs' padding sink)
    num_reserved_blocks = 0
    description = "eager"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def prepare(self, batch: AttentionBatch, input_ids: torch.Tensor, positions: torch.Tensor):
        """Reshape a step before its metadata is built (padding); returns (batch, input_ids, positions)."""
        return batch, input_ids, positions

    def set_num_blocks(self, num_blocks: int) -> None:
        """The KV cache was (re)allocated with `num_blocks` scheduler blocks (+ the reserved ones)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
        return self.model(input_ids, positions, step)


class TorchCompileForward(EagerForward):
    """`torch.compile(model)` with the token dimension dynamic and attention opaque."""

    def __init__(self, model: nn.Module, backend: str, mode: str | None) -> None:
        super().__init__(model)
        if backend == "inductor":
            configure_compile_cache()
        self.attention_layers = make_attention_opaque(model)
        self.compiled = torch.compile(model, backend=backend, mode=mode, dynamic=None)
        self.description = f"torch.compile(backend={backend!r}, mode={mode!r})"

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
        # one graph for every token count (torch still specializes 0 and 1 on its own)
        torch._dynamo.maybe_mark_dynamic(input_ids, 0)
        torch._dynamo.maybe_mark_dynamic(positions, 0)
        with step_context(step, self.attention_layers):
            return self.compiled(input_ids, positions, step)


# ----- graphs for decode -------------------------------------------------------------------


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
        self.buckets = tuple(buckets) if buckets is not None else decode_buckets(max_num_seqs)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.graphs = graphs
        self.captured: dict[int, _CapturedDecode] = {}
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
        entry = self.captured.get(bucket)
        if entry is None:
            out = self.model(input_ids, positions, step)  # the real step, and the warm-up
            static = _CapturedDecode(None, input_ids.clone(), positions.clone(), step, out)
            static.graph, static.output = self.graphs.capture(lambda: self.model(static.input_ids, static.positions, static.step))
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


# ----- choosing ---------------------------------------------------------------------------

INDUCTOR_MODES = {"default": None, "max": "max-autotune-no-cudagraphs"}


def build_forward(
    model: nn.Module,
    plan: ExecutionPlan,
    *,
    max_num_seqs: int,
    max_model_len: int,
    is_pooling: bool = False,
    graph_capture: GraphCapture | None = None,
) -> EagerForward:
    """The forward the plan's compilation choice asks for (see the module docstring).

    :param is_pooling: an encoder (no KV cache, no decode steps): decode graphs do not apply.
    :param graph_capture: the platform's recorder for `plan.compile_backend`
        (`Platform.graph_capture`), None when that backend is a torch.compile one.
    """
    mode, backend = plan.compilation.name, plan.compile_backend
    if mode == "none" or backend is None:
        return EagerForward(model)
    if graph_capture is not None:
        if is_pooling:
            return EagerForward(model)
        return DecodeGraphForward(
            model, max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=plan.block_size, graphs=graph_capture
        )
    if backend == "inductor":
        return TorchCompileForward(model, "inductor", INDUCTOR_MODES.get(mode))
    # any other dynamo backend a platform names ("openxla" on TPU), in its default mode
    return TorchCompileForward(model, backend, None)
