"""Graph compilation of the model's forward, by the compile backend the ExecutionPlan names.

The plan's `compilation` choice is a mode ("none", "default", "max") and the platform's
`compile_backends` map it to a backend; `build_forward` turns that into the callable the
model runner uses for `model(input_ids, positions, step)`:

- "none" -> `EagerForward`: the model as it is.
- "inductor" (XPU; CPU, CUDA, ROCm "max") -> `TorchCompileForward`: `torch.compile` with
  the token dimension dynamic (one graph for every batch size, plus the size-1 graph
  torch specializes); "max" adds inductor's max-autotune GEMM search. Compiled kernels
  land in inductor's on-disk caches under portaserve's cache folder
  (`compile_cache_dir()`), so a second start with the same model and torch reuses them.
- a backend the platform records graphs for (`Platform.graph_capture` returns a
  recorder: CUDA graphs for CUDA/ROCm "default", recorded C kernel calls for CPU
  "default") -> `DecodeGraphForward` (in `decode_graphs`): pure-decode steps replayed
  from per-bucket graphs. Nothing is traced, so the plan keeps untraceable components.
- any other name (TPU's "openxla") -> `TorchCompileForward` with that dynamo backend.

Attention stays out of the graphs: its metadata is Python objects that change every
step (sequence groups, split counts), which would make dynamo re-specialize without end.
Each attention layer is wrapped (`OpaqueAttention`) so that while compiling it becomes
one call of the custom op `portaserve::attention`, which runs the layer eagerly with the
step's context (set around every compiled call). Decode graphs instead capture attention
too (see `decode_graphs`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from portaserve.framework.interfaces import AttentionBackend, AttentionBatch
from portaserve.framework.interfaces.graph_capture import GraphCapture
from portaserve.framework.layer_context import StepContext
from portaserve.framework.plan import ExecutionPlan

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
    # decode_graphs builds on EagerForward, so it is imported here, not at the top
    from .decode_graphs import DecodeGraphForward

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
