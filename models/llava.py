"""LLaVA: a CLIP or SigLIP vision tower, a two-layer MLP projector and a Llama-family
language model (`LlavaForConditionalGeneration`).

Each image becomes `num_image_tokens` embeddings: the patch features of one vision
layer (`vision_feature_layer`, or several concatenated), without the class token under
the "default" selection strategy, projected to the language model's width. The prompt
carries that many image placeholder tokens (`image_token_index`); their embeddings are
replaced by the image's before the decoder runs (`StepContext.mm_embeds`).

Checkpoint names: both layouts load, the llava-hf one (`language_model.model.*`,
`vision_tower.vision_model.*`, `multi_modal_projector.*`) and the one transformers 5
writes in memory (`model.language_model.*`, `model.vision_tower.*`, `lm_head.*`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from portaserve.framework.interfaces import AttentionSpec, ModelArchitecture
from portaserve.framework.layer_context import LayerContext, StepContext
from portaserve.framework.multimodal.inputs import MultiModalFeature
from portaserve.framework.multimodal.preprocess import build_image_processor, read_processor_config
from portaserve.framework.multimodal.processor import ImagePromptProcessor

from .clip import VISION, VisionEncoder, is_siglip, vision_attention_spec
from .layers.activation import Activation
from .layers.linear import ColumnParallelLinear, RowParallelLinear
from .layers.loading import LLAMA_STACKED, load_checkpoint
from .llama import LlamaForCausalLM
from .qwen2 import Qwen2ForCausalLM

_LANGUAGE_MODELS = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mistral": LlamaForCausalLM}


def text_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    return dict(hf_config.get("text_config") or {})


def language_model_class(hf_config: Mapping[str, Any]) -> type[LlamaForCausalLM]:
    kind = str(text_config(hf_config).get("model_type", "llama"))
    if kind not in _LANGUAGE_MODELS:
        raise ValueError(f"text_config.model_type {kind!r}: supported: {', '.join(_LANGUAGE_MODELS)}")
    return _LANGUAGE_MODELS[kind]


def feature_layers(hf_config: Mapping[str, Any]) -> tuple[int, ...]:
    """`vision_feature_layer` as indices into transformers' hidden_states (0 = embeddings)."""
    num_layers = int(hf_config["vision_config"]["num_hidden_layers"])
    layers = hf_config.get("vision_feature_layer", -2)
    layers = layers if isinstance(layers, list) else [layers]
    return tuple(int(i) if int(i) >= 0 else num_layers + 1 + int(i) for i in layers)


def image_tokens_per_image(hf_config: Mapping[str, Any]) -> int:
    vision = hf_config["vision_config"]
    tokens = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
    if not is_siglip(vision) and hf_config.get("vision_feature_select_strategy", "default") == "full":
        tokens += 1  # the class token stays
    return tokens


class MultiModalProjector(nn.Module):
    def __init__(self, hf_config: Mapping[str, Any], ctx: LayerContext) -> None:
        super().__init__()
        vision_hidden = int(hf_config["vision_config"]["hidden_size"]) * len(feature_layers(hf_config))
        text_hidden = int(text_config(hf_config)["hidden_size"])
        bias = bool(hf_config.get("multimodal_projector_bias", True))
        self.linear_1 = ColumnParallelLinear(vision_hidden, text_hidden, bias, ctx, "multi_modal_projector.linear_1")
        self.act = Activation(str(hf_config.get("projector_hidden_act", "gelu")))
        self.linear_2 = RowParallelLinear(text_hidden, text_hidden, bias, ctx, "multi_modal_projector.linear_2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(ModelArchitecture):
    is_pooling = False

    @classmethod
    def attention_specs(cls, hf_config, dtype: torch.dtype, kv_cache_dtype: str) -> dict[str, AttentionSpec]:
        specs = language_model_class(hf_config).attention_specs(text_config(hf_config), dtype, kv_cache_dtype)
        specs[VISION] = vision_attention_spec(hf_config["vision_config"], dtype, kv_cache_dtype)
        return specs

    @classmethod
    def attention_layer_types(cls, hf_config) -> list[str]:
        return language_model_class(hf_config).attention_layer_types(text_config(hf_config))

    @classmethod
    def max_model_len(cls, hf_config) -> int:
        return language_model_class(hf_config).max_model_len(text_config(hf_config))

    @classmethod
    def unsupported_reason(cls, hf_config, tensor_parallel_size: int) -> str | None:
        try:
            language_model_class(hf_config)
        except ValueError as exc:
            return str(exc)
        if hf_config.get("vision_feature_select_strategy", "default") not in ("default", "full"):
            return f"vision_feature_select_strategy {hf_config['vision_feature_select_strategy']!r} is not supported"
        return None

    @classmethod
    def multimodal_processor(cls, hf_config: Mapping[str, Any], model_path: str | Path) -> ImagePromptProcessor:
        vision = hf_config["vision_config"]
        cfg = read_processor_config(model_path)
        default = "SiglipImageProcessor" if is_siglip(vision) else "CLIPImageProcessor"
        if not cfg:  # no processor files: the tower's own input size
            side = int(vision["image_size"])
            cfg = {"size": {"height": side, "width": side}} if is_siglip(vision) else {
                "size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}
        tokens = image_tokens_per_image(hf_config)
        return ImagePromptProcessor(
            image_processor=build_image_processor(cfg, default),
            placeholder_token_id=int(hf_config.get("image_token_index", hf_config.get("image_token_id", 32000))),
            num_tokens=lambda processed: tokens,
            key=f"llava:{sorted(cfg.items())!r}",
        )

    @classmethod
    def build(cls, hf_config, ctx: LayerContext) -> "LlavaForConditionalGeneration":
        return cls(hf_config, ctx)

    def __init__(self, hf_config: Mapping[str, Any], ctx: LayerContext) -> None:
        super().__init__()
        self.feature_layers = feature_layers(hf_config)
        self.drop_class_token = (not is_siglip(hf_config["vision_config"])
                                 and hf_config.get("vision_feature_select_strategy", "default") == "default")
        self.vision_tower = VisionEncoder(hf_config["vision_config"], max(self.feature_layers), ctx)
        self.multi_modal_projector = MultiModalProjector(hf_config, ctx)
        self.language_model = language_model_class(hf_config).build(text_config(hf_config), ctx)

    def embed_multimodal(self, features: Sequence[MultiModalFeature]) -> list[torch.Tensor]:
        """Each image's embeddings: [num_image_tokens, text_hidden] per feature."""
        device = self.vision_tower.embeddings.position_embedding.weight.device
        pixels = torch.stack([torch.from_numpy(f.pixels().copy()) for f in features]).to(device)
        layers = self.vision_tower(pixels, self.feature_layers)
        if self.drop_class_token:
            layers = [h[:, 1:] for h in layers]
        hidden = torch.cat(layers, dim=-1)
        num_images, tokens, width = hidden.shape
        projected = self.multi_modal_projector(hidden.reshape(num_images * tokens, width))
        return list(projected.reshape(num_images, tokens, -1).unbind(0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
        decoder = self.language_model.model
        return decoder.decode(decoder.embed(input_ids, step), positions, step)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, weights, LLAMA_STACKED, self._checkpoint_name)

    def _checkpoint_name(self, name: str) -> str | None:
        if name.startswith("model."):  # transformers 5's in-memory layout
            name = name[len("model."):]
            if name.startswith("language_model."):
                name = "language_model.model." + name[len("language_model."):]
        elif name.startswith("lm_head."):
            name = "language_model." + name
        name = name.replace("vision_tower.vision_model.", "vision_tower.")
        if name.startswith("vision_tower."):
            rest = name[len("vision_tower."):]
            if rest.startswith(("post_layernorm.", "head.")):
                return None  # after the layer LLaVA reads
            if rest.startswith("encoder.layers."):
                index = int(rest.split(".")[2])
                if index >= len(self.vision_tower.layers):
                    return None
                return "vision_tower." + rest[len("encoder."):]
            return name
        if name.startswith("language_model."):
            inner = self.language_model._checkpoint_name(name[len("language_model."):])
            return None if inner is None else "language_model." + inner
        return name
