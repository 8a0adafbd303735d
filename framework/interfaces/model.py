"""The model-architecture interface the engine runs, registered by name through
`portaserve_model_architectures` (the HF `architectures` entry of config.json), or for
one platform through `portaserve_platform_model_architectures`.

What a model receives from the engine is described here by two Protocols, so a plugin
writes a model against this module alone: `ModelBuildContext` (the `ctx` given to
`build`; the engine's `LayerContext`) and `ModelStepContext` (the `step` given to
`forward`; the engine's `StepContext`).

What the engine expects of a model, besides the methods below:

- **Linear layers** are modules with a `quant_method` attribute (from
  `ctx.quant_method(prefix)`) whose parameters that method created with
  `create_weights`. After loading, the engine calls
  `quant_method.process_weights_after_loading(module)` on every module that has one,
  and for sleep level 2 `release_weights` / `restore_weights`; a module without the
  attribute is never touched. An LM head (never quantized) uses
  `ctx.quant_method(prefix, unquantized=True)`; one tied to the embedding sets
  `keep_dense_weight = True` on itself so a repacking method keeps the dense weight the
  embedding reads.
- **Loading** (`load_weights`) routes every checkpoint tensor through
  `getattr(param, "weight_loader", default)(param, tensor[, shard_id])`: a live weight
  update replaces those loaders to stage new values, so a model that copies directly
  would change serving weights unstaged. Parameters a method marks
  `derived_after_loading` (computed scales) are not expected from the checkpoint.
  Names that match nothing, and parameters left unfilled, raise
  `portaserve.framework.errors.InvalidParameterError` (the update path reports those to
  the caller and keeps serving; other exceptions are engine errors).
- **Attention** goes through `ctx.attention_backend(layer_type)`; layer `i`'s cache is
  `step.kv_caches[i]` in `attention_layer_types` order.
- **Ops** are called by name, `ctx.ops.get("rms_norm")(x, w, eps)`: the platform's
  implementation or the torch reference (see `interfaces.ops`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from .attention import AttentionBackend, AttentionMetadata, AttentionSpec
from .communicator import Communicator
from .quantization import QuantMethod


class OpLookup(Protocol):
    def get(self, name: str) -> Callable:
        """The bound implementation of op `name` (the platform's, else the reference);
        KeyError naming the declared ops for an undeclared one."""


class ModelBuildContext(Protocol):
    """What `ModelArchitecture.build` receives (the engine's `LayerContext`)."""

    #: activation dtype of the plan; `device`: where parameters live on this rank
    dtype: torch.dtype
    device: torch.device
    #: tensor-parallel rank and size; `communicator` is None at size 1
    tp_rank: int
    tp_size: int
    communicator: Communicator | None
    ops: OpLookup

    def quant_method(self, prefix: str = "", *, unquantized: bool = False) -> QuantMethod:
        """A fresh QuantMethod for the linear layer at `prefix` ("model.layers.0.mlp.down_proj")."""

    def attention_backend(self, layer_type: str) -> AttentionBackend:
        """The backend instance serving `layer_type` layers on this rank (heads already split)."""

    def rank_spec(self, layer_type: str) -> AttentionSpec:
        """`layer_type`'s AttentionSpec as this rank sees it (heads split across ranks)."""


class ModelStepContext(Protocol):
    """What `forward` receives each step (the engine's `StepContext`)."""

    #: layer type -> the metadata its backend built for this step
    attn_metadata: Mapping[str, AttentionMetadata]
    #: one cache tensor per attention layer, in `attention_layer_types` order; empty for encoders
    kv_caches: Sequence[torch.Tensor]
    #: [num_seqs + 1] int32 host offsets of each sequence's tokens (pooling needs them)
    query_start_loc: torch.Tensor | None
    #: (rows [n] int64, values [n, hidden]) or None: embeddings that replace the token
    #: embeddings of those rows (image placeholders; contract 1.4)
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None


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
    def build(cls, hf_config: Mapping[str, Any], ctx: ModelBuildContext) -> "ModelArchitecture":
        """Construct the module (parameters on ctx's device, uninitialized) for this rank."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into parameters; returns the names it loaded."""

    @classmethod
    def unsupported_reason(cls, hf_config: Mapping[str, Any], tensor_parallel_size: int) -> str | None:
        """Why this implementation cannot run the checkpoint `hf_config` split over
        `tensor_parallel_size` ranks (a rope scaling it lacks, KV heads that do not divide),
        or None. The plan asks before any weight loads; for a platform's own
        implementation, a reason makes the plan fall back to the generic one and say why.
        (Contract 1.1; the default accepts everything.)"""
        return None

    @classmethod
    def max_model_len(cls, hf_config: Mapping[str, Any]) -> int:
        """Longest sequence the checkpoint supports."""
        return int(hf_config.get("max_position_embeddings", 2048))

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: ModelStepContext) -> torch.Tensor:
        """Run the model over one step's tokens (the engine calls it as `model(...)`).

        :param input_ids: [num_tokens] int64, the tokens of sequence 0, then sequence 1, ...
        :param positions: [num_tokens] int64, each token's position in its sequence
        :param step: the step's attention metadata and KV caches (`ModelStepContext`)
        :returns: hidden: [num_tokens, hidden_size]
        """

    @classmethod
    def multimodal_processor(cls, hf_config: Mapping[str, Any], model_path: Any) -> Any:
        """How the front end prepares this model's images, or None for a text-only model
        (the default). A vision-language model returns a
        `portaserve.framework.multimodal.processor.ImagePromptProcessor`: its image
        preprocessing (from the checkpoint's processor config), the placeholder token a
        prompt carries once per image, and the number of embeddings an image becomes;
        the engine expands each placeholder to that many tokens. (Contract 1.4.)"""
        return None

    @classmethod
    def lora_modules(cls, hf_config: Mapping[str, Any]) -> dict[str, tuple[int, int]] | None:
        """The modules a LoRA adapter may target, by checkpoint name, with their full
        (in_features, out_features), or None when this architecture takes no adapters (the
        default). The front end checks an adapter's tensors against them before a request
        runs; the model's linear layers hold the adapters (they do, for every layer whose
        name the adapter targets, once built with a LayerContext carrying LoRA slots).
        (Contract 1.6.)"""
        return None

    def embed_multimodal(self, features: Sequence[Any]) -> list[torch.Tensor]:
        """The input embeddings of images: one [feature.length, hidden_size] tensor per
        `MultiModalFeature` (its `pixels()` and `grid_thw`). The engine caches them by the
        image's hash and passes the rows a step needs as `step.mm_embeds`, which
        `forward` writes over the placeholder tokens' embeddings. (Contract 1.4.)"""
        raise NotImplementedError(f"{type(self).__name__} takes no images")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits of the rows the sampler needs (decoders; an encoder has none).

        :param hidden: [num_selected, hidden_size], rows of `forward`'s output
        :returns: [num_selected, vocab_size]
        """
        raise NotImplementedError(f"{type(self).__name__} defines no compute_logits (encoders have no logits)")

    def pool(self, hidden: torch.Tensor, step: ModelStepContext) -> torch.Tensor:
        """One embedding per sequence (encoders, `is_pooling = True`; a decoder has none).

        :param hidden: [num_tokens, hidden_size], `forward`'s output
        :param step: the same step (`query_start_loc` bounds each sequence's tokens)
        :returns: [num_seqs, hidden_size]
        """
        raise NotImplementedError(f"{type(self).__name__} defines no pool (decoders produce no embeddings)")
