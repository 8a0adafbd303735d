"""CLIP and SigLIP vision encoders: the vision towers of LLaVA-style models.

A ViT: the image cut into patches by a strided convolution, learned position
embeddings (CLIP adds a class token and a LayerNorm before the layers), then pre-norm
layers of bidirectional self-attention and an MLP. Attention goes through the plan's
backend for the "vision" layer type, which the model declares non-causal (no KV
cache), so a platform supplies encoder attention the same way as decoder attention;
each image is one sequence of that step.

Only the layers up to the one the language model reads are built (`num_layers_used`):
LLaVA reads the second-to-last layer's output, so the last layer and the final norm of
the tower are skipped, as are their checkpoint tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from portaserve.framework.interfaces import AttentionBatch, AttentionSpec
from portaserve.framework.layer_context import LayerContext, StepContext

from .layers.activation import Activation
from .layers.attention import Attention
from .layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from .layers.norm import LayerNorm

VISION = "vision"


def is_siglip(vision_config: Mapping[str, Any]) -> bool:
    return str(vision_config.get("model_type", "clip_vision_model")).startswith("siglip")


def vision_attention_spec(vision_config: Mapping[str, Any], dtype: torch.dtype, kv_cache_dtype: str) -> AttentionSpec:
    heads = int(vision_config["num_attention_heads"])
    head_dim = int(vision_config["hidden_size"]) // heads
    return AttentionSpec(num_heads=heads, num_kv_heads=heads, head_size=head_dim, scale=head_dim**-0.5, dtype=dtype,
                         kv_cache_dtype=kv_cache_dtype, causal=False)


def encoder_step(backend, lengths: list[int]) -> StepContext:
    """A StepContext in which each of `lengths` is one bidirectional sequence (no KV cache)."""
    qsl = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    total = int(qsl[-1])
    batch = AttentionBatch(
        query_start_loc=qsl,
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_table=torch.zeros(len(lengths), 1, dtype=torch.int32),
        slot_mapping=torch.zeros(total, dtype=torch.int64),
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
        block_size=int(getattr(backend, "block_size", 16)),
        num_actual_tokens=total,
    )
    return StepContext(attn_metadata={VISION: backend.build_metadata(batch)}, query_start_loc=qsl)


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], ctx: LayerContext) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        self.patch_size = int(cfg["patch_size"])
        self.has_class_token = not is_siglip(cfg)
        self.patch_embedding = nn.Conv2d(int(cfg.get("num_channels", 3)), hidden, self.patch_size, self.patch_size,
                                         bias=not self.has_class_token, dtype=ctx.dtype)
        num_positions = (int(cfg["image_size"]) // self.patch_size) ** 2 + int(self.has_class_token)
        if self.has_class_token:
            self.class_embedding = nn.Parameter(torch.empty(hidden, dtype=ctx.dtype))
        self.position_embedding = nn.Embedding(num_positions, hidden, dtype=ctx.dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [num_images, 3, H, W] -> [num_images, tokens, hidden]."""
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.has_class_token:
            cls = self.class_embedding.expand(patches.shape[0], 1, -1)
            patches = torch.cat([cls, patches], dim=1)
        if patches.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(f"image gives {patches.shape[1]} tokens; the encoder was trained on "
                             f"{self.position_embedding.num_embeddings}")
        return patches + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer_idx: int, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        self.head_dim = hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, heads, True, ctx, f"{prefix}.qkv_proj")
        self.q_size = self.qkv_proj.q_size
        self.attn = Attention(self.qkv_proj.num_heads_per_rank, self.qkv_proj.num_kv_heads_per_rank, self.head_dim,
                              layer_idx, VISION, ctx)
        self.out_proj = RowParallelLinear(hidden, hidden, True, ctx, f"{prefix}.out_proj")

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        shape = (x.shape[0], -1, self.head_dim)
        return self.out_proj(self.attn(q.reshape(shape), k.reshape(shape), v.reshape(shape), step))


class VisionMLP(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        default_act = "gelu_pytorch_tanh" if is_siglip(cfg) else "quick_gelu"
        self.fc1 = ColumnParallelLinear(hidden, inter, True, ctx, f"{prefix}.fc1")
        self.act = Activation(str(cfg.get("hidden_act", default_act)))
        self.fc2 = RowParallelLinear(inter, hidden, True, ctx, f"{prefix}.fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], layer_idx: int, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg.get("layer_norm_eps", 1e-5 if not is_siglip(cfg) else 1e-6))
        self.layer_norm1 = LayerNorm(hidden, eps, ctx)
        self.self_attn = VisionAttention(cfg, layer_idx, ctx, f"{prefix}.self_attn")
        self.layer_norm2 = LayerNorm(hidden, eps, ctx)
        self.mlp = VisionMLP(cfg, ctx, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), step)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """The tower up to layer `num_layers_used`; returns the hidden states after each of
    the layers in `keep` (0 = the embeddings, as transformers' `hidden_states[0]`)."""

    def __init__(self, cfg: Mapping[str, Any], num_layers_used: int, ctx: LayerContext) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg, ctx)
        hidden = int(cfg["hidden_size"])
        if not is_siglip(cfg):
            self.pre_layrnorm = LayerNorm(hidden, float(cfg.get("layer_norm_eps", 1e-5)), ctx)  # (sic) HF's name
        else:
            self.pre_layrnorm = None
        self.layers = nn.ModuleList(VisionLayer(cfg, i, ctx, f"vision_tower.encoder.layers.{i}") for i in range(num_layers_used))
        self.backend = ctx.attention_backend(VISION)

    def forward(self, pixels: torch.Tensor, keep: tuple[int, ...]) -> list[torch.Tensor]:
        """pixels: [num_images, 3, H, W] -> per kept index, [num_images, tokens, hidden]."""
        x = self.embeddings(pixels)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        num_images, tokens, hidden = x.shape
        step = encoder_step(self.backend, [tokens] * num_images)
        flat = x.reshape(num_images * tokens, hidden)
        kept = {0: flat} if 0 in keep else {}
        for i, layer in enumerate(self.layers, start=1):
            flat = layer(flat, step)
            if i in keep:
                kept[i] = flat
        return [kept[i].reshape(num_images, tokens, hidden) for i in keep]
