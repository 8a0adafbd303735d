"""The model-architecture interface the engine runs, registered by name through
`portaserve_model_architectures` (the HF `architectures` entry of config.json)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from .attention import AttentionSpec

if TYPE_CHECKING:
    from portaserve.framework.layer_context import LayerContext


class ModelArchitecture(nn.Module, ABC):
    """A runnable model: a decoder (`is_pooling = False`) or an encoder for embeddings."""

    #: True for encoders that produce embeddings rather than next-token logits.
    is_pooling: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def attention_specs(cls, hf_config: Mapping[str, Any], dtype: torch.dtype, kv_cache_dtype: str) -> dict[str, AttentionSpec]:
        """Layer type name -> the attention it needs; read from config.json before any weight loads."""

    @classmethod
    @abstractmethod
    def attention_layer_types(cls, hf_config: Mapping[str, Any]) -> list[str]:
        """The layer type (a key of `attention_specs`) of each attention layer, in `layer_idx`
        order: entry i describes `StepContext.kv_caches[i]`. Empty for encoders (no KV cache).
        The engine sizes and allocates the KV cache from this before building the model."""

    @classmethod
    @abstractmethod
    def build(cls, hf_config: Mapping[str, Any], ctx: "LayerContext") -> "ModelArchitecture":
        """Construct the module (parameters on ctx's device, uninitialized) for this rank."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into parameters; returns the names it loaded."""

    @classmethod
    def max_model_len(cls, hf_config: Mapping[str, Any]) -> int:
        """Longest sequence the checkpoint supports."""
        return int(hf_config.get("max_position_embeddings", 2048))

    # The engine calls these two; subclasses define them (nn.Module.forward style):
    #
    #   forward(input_ids: [num_tokens] int64, positions: [num_tokens] int64,
    #           step: StepContext) -> hidden: [num_tokens, hidden_size]
    #   compute_logits(hidden: [num_selected, hidden_size]) -> [num_selected, vocab_size]  (decoders)
    #   pool(hidden, step) -> [num_seqs, hidden_size]                                   (encoders)
