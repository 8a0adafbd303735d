"""What layers see: `LayerContext` when a model is built, `StepContext` on every forward.

Models and layers never import a platform or a kernel; they get their QuantMethod,
AttentionBackend instances and fused ops from the LayerContext, which the worker builds
from the ExecutionPlan (looked up by name in the plugin registry, never re-selected).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .interfaces import AttentionBackend, AttentionMetadata, AttentionSpec, Communicator, QuantMethod
from .interfaces.ops import REFERENCE
from .plan import ExecutionPlan
from .plugins import PluginRegistry


class OpTable:
    """The plan's op bindings: `get(name)` is the platform's implementation of a declared
    op, or its torch reference where none is bound, so a model calls every op the same way."""

    def __init__(self, ops: Mapping[str, Callable] | None = None, bound: Mapping[str, str] | None = None) -> None:
        self._ops = dict(ops or {})
        self._bound = dict(bound or {})

    def get(self, name: str) -> Callable:
        try:
            return self._ops[name]
        except KeyError:
            raise KeyError(f"op {name!r} is not declared; declared ops: {', '.join(sorted(self._ops))} "
                           "(a plugin declares new ops with portaserve_op_specs)") from None

    def binding(self, name: str) -> str:
        """The implementation bound to `name` ("reference" for the torch reference)."""
        return self._bound.get(name, REFERENCE)

    def names(self) -> dict[str, str]:
        return {k: getattr(v, "__qualname__", repr(v)) for k, v in self._ops.items()}


@dataclass
class LayerContext:
    """Everything a model needs to construct its layers on one rank."""

    plan: ExecutionPlan
    registry: PluginRegistry
    device: torch.device
    tp_rank: int = 0
    tp_size: int = 1
    communicator: Communicator | None = None
    ops: OpTable = field(default_factory=OpTable)
    #: the adapters' shared state (framework/lora/manager.py LoRAState) when the engine
    #: serves LoRA adapters: the layers that take adapters allocate their slots from it
    lora: Any = None
    _attention: dict[str, AttentionBackend] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return self.plan.torch_dtype

    def quant_method(self, prefix: str = "", *, unquantized: bool = False) -> QuantMethod:
        """A fresh QuantMethod instance for the linear layer at `prefix` (e.g. 'model.layers.0.mlp').

        :param unquantized: for a layer that is never quantized (the LM head): "none" or
            the platform's variant of it, whatever --quantization says.
        """
        name = self.plan.unquantized_method if unquantized else self.plan.quantization.name
        cls = self.registry.get("quant_methods", name)
        method = cls(dict(self.plan.quantization_config))
        method.prefix = prefix
        method.platform_features = frozenset(self.plan.platform_features)
        return method

    def embedding_method(self, prefix: str) -> QuantMethod | None:
        """The plan's QuantMethod for the embedding table at `prefix` when it stores that
        table quantized (`QuantMethod.quantizes_embedding`), else None (a dense table)."""
        method = self.quant_method(prefix)
        return method if method.quantizes_embedding() else None

    def attention_backend(self, layer_type: str) -> AttentionBackend:
        """The backend instance serving `layer_type` layers (shared by all such layers)."""
        backend = self._attention.get(layer_type)
        if backend is None:
            cls = self.registry.get("attention_backends", self.plan.attention_backend_for(layer_type).name)
            backend = cls(self.rank_spec(layer_type), self.plan.block_size, self.device)
            self._attention[layer_type] = backend
        return backend

    def rank_spec(self, layer_type: str) -> AttentionSpec:
        """The plan's spec for `layer_type` as this rank sees it: query heads split across
        the tensor-parallel ranks, KV heads split too, or replicated (one per rank) when
        there are fewer KV heads than ranks."""
        spec = self.plan.spec_for(layer_type)
        if self.tp_size == 1:
            return spec
        return dataclasses.replace(
            spec,
            num_heads=spec.num_heads // self.tp_size,
            num_kv_heads=max(1, spec.num_kv_heads // self.tp_size),
        )

    def attention_backends(self) -> dict[str, AttentionBackend]:
        """Every layer type's backend, instantiated (the runner builds metadata with them)."""
        return {t: self.attention_backend(t) for t, _ in self.plan.attention}

    @classmethod
    def from_plan(
        cls,
        plan: ExecutionPlan,
        registry: PluginRegistry,
        device: torch.device,
        tp_rank: int = 0,
        tp_size: int = 1,
        communicator: Communicator | None = None,
    ) -> "LayerContext":
        impls = {name: sp.load_reference() for name, (_plugin, sp) in registry.op_specs.items()}
        bound = {}
        for op, impl_name in plan.custom_ops:
            if impl_name == REFERENCE:
                continue
            for _plugin, impl in registry.custom_ops:
                if impl.op == op and impl.name == impl_name:
                    impls[op] = impl.load()
                    bound[op] = impl_name
                    break
        return cls(plan, registry, device, tp_rank, tp_size, communicator, OpTable(impls, bound))


@dataclass(frozen=True, slots=True)
class StepContext:
    """Per-forward inputs besides token ids and positions."""

    #: layer type -> metadata built by that type's backend for this step
    attn_metadata: Mapping[str, AttentionMetadata]
    #: one KV tensor per attention layer (index = the layer's `layer_idx`); empty for encoders
    kv_caches: Sequence[torch.Tensor] = ()
    #: query_start_loc: [num_seqs + 1] int32 on the host (pooling needs sequence bounds)
    query_start_loc: torch.Tensor | None = None
    #: (rows [n] int64, values [n, hidden]): input embeddings that replace the token
    #: embeddings at those rows of the step (image placeholders); None for text-only steps
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
