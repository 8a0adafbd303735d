"""Qwen2-VL and Qwen2.5-VL: a ViT over dynamic-resolution patches, a patch merger, and the
Qwen2 decoder with multimodal RoPE (`Qwen2VLForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`).

Vision: the preprocessor (framework/multimodal/preprocess.py) cuts an image into patches
of 3 x temporal_patch_size x 14 x 14 values, ordered so the 2 x 2 patches the merger joins
are adjacent. A linear patch embedding (transformers keeps it as a Conv3d whose stride is
its kernel: the same matmul), blocks of pre-norm attention with 2-D rotary positions
(row, column) and an MLP, then the merger: norm, 2 x 2 patches concatenated, a two-layer
MLP to the decoder's width. An image of grid (1, h, w) gives h * w / 4 embeddings.
Qwen2.5-VL: RMSNorm, a gated SiLU MLP, and attention within windows of
window_size pixels except in the `fullatt_block_indexes` blocks (patches are reordered
window by window, and back after the merger). Attention goes through the plan's
backend for the "vision" layer type (non-causal; a window or an image per sequence).

Decoder: the Qwen2 decoder, except that a token's rotary position has three parts
(temporal, height, width) whose frequencies are interleaved by `mrope_section`. Text
tokens have three equal parts (ordinary RoPE); an image's tokens have their grid row and
column, and the text after an image continues from past the image's largest position.
`rope_positions` gives a prompt's positions once; the runner passes [3, n] positions
for steps that hold image tokens and shifted 1-D positions otherwise, so decode steps
(graphs included) are a plain decoder's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from portaserve.framework.interfaces import AttentionSpec
from portaserve.framework.layer_context import LayerContext, StepContext
from portaserve.framework.multimodal.inputs import MultiModalFeature
from portaserve.framework.multimodal.preprocess import build_image_processor, read_processor_config
from portaserve.framework.multimodal.processor import ImagePromptProcessor

from .clip import VISION, encoder_step
from .layers.activation import Activation, ActAndMul, SiluAndMul
from .layers.attention import Attention
from .layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from .layers.loading import LLAMA_STACKED, load_checkpoint
from .layers.norm import LayerNorm, RMSNorm
from .llama import DecoderConfig
from .qwen2 import Qwen2ForCausalLM, windowed_layer_types


def _text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's settings: `text_config` (transformers 5) or the top level (the hub's files)."""
    text = dict(hf.get("text_config") or hf)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or hf.get("rope_scaling") or {})
    if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":  # older files name it so
        rope.pop("type", None)
        rope["rope_type"] = "default"
    rope.setdefault("rope_theta", text.get("rope_theta", 1000000.0))
    text["rope_parameters"] = rope
    text.pop("rope_scaling", None)
    return text


def mrope_section(hf: Mapping[str, Any]) -> tuple[int, ...]:
    return tuple(int(n) for n in _text_config(hf)["rope_parameters"].get("mrope_section", (16, 24, 24)))


def vision_positions(grids: Sequence[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[num_patches, 2] (row, column) of each patch, in the merger's block-major order."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h, 1).expand(h, w)
        cols = torch.arange(w).view(1, w).expand(h, w)
        shape = (h // merge, merge, w // merge, merge)
        pos = torch.stack([rows.reshape(shape).transpose(1, 2).flatten(), cols.reshape(shape).transpose(1, 2).flatten()], -1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out)


def window_order(grids: Sequence[tuple[int, int, int]], merge: int, window: int, patch: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: (merged-token order window by window, patches per window)."""
    side = window // merge // patch  # merged tokens per window side
    order, lengths, base = [], [], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = -gh % side, -gw % side
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        windows = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, side * side)
        for win in windows:
            kept = win[win >= 0]
            if kept.numel():
                order.append(kept + base)
                lengths.append(int(kept.numel()) * merge * merge)
        base += t * gh * gw
    return torch.cat(order), lengths


class VisionRotary:
    """2-D rotary angles of the vision tower: half the frequencies for the row, half for the column."""

    def __init__(self, head_dim: int, theta: float) -> None:
        spatial = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [n, 2, spatial / 2]
        freqs = freqs.flatten(1)  # rows' then columns' frequencies
        freqs = torch.cat([freqs, freqs], dim=-1)  # [n, head_dim]
        return freqs.cos(), freqs.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [n, heads, head_dim], rotated (neox halves) in float32 as transformers does."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


class VisionBlock(nn.Module):
    def __init__(self, vc: Mapping[str, Any], qwen25: bool, dim: int, layer_idx: int, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        heads = int(vc["num_heads"])
        self.head_dim = dim // heads
        norm = (lambda: RMSNorm(dim, 1e-6, ctx)) if qwen25 else (lambda: LayerNorm(dim, 1e-6, ctx))
        self.norm1, self.norm2 = norm(), norm()
        self.qkv_proj = QKVParallelLinear(dim, self.head_dim, heads, heads, True, ctx, f"{prefix}.attn.qkv_proj")
        self.attn = Attention(self.qkv_proj.num_heads_per_rank, self.qkv_proj.num_kv_heads_per_rank, self.head_dim,
                              layer_idx, VISION, ctx)
        self.proj = RowParallelLinear(dim, dim, True, ctx, f"{prefix}.attn.proj")
        act = str(vc.get("hidden_act", "silu" if qwen25 else "quick_gelu"))
        if qwen25:
            inter = int(vc["intermediate_size"])
            self.gate_up_proj = MergedColumnParallelLinear(dim, [inter, inter], True, ctx, f"{prefix}.mlp.gate_up_proj")
            self.act = SiluAndMul(ctx) if act in ("silu", "swish") else ActAndMul(act)
            self.down_proj = RowParallelLinear(inter, dim, True, ctx, f"{prefix}.mlp.down_proj")
        else:
            inter = int(dim * float(vc.get("mlp_ratio", 4)))
            self.fc1 = ColumnParallelLinear(dim, inter, True, ctx, f"{prefix}.mlp.fc1")
            self.act = Activation(act)
            self.fc2 = RowParallelLinear(inter, dim, True, ctx, f"{prefix}.mlp.fc2")
        self.gated = qwen25

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepContext) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = self.qkv_proj(h).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        shape = (x.shape[0], -1, self.head_dim)
        q, k = _rotate(q.reshape(shape), cos, sin), _rotate(k.reshape(shape), cos, sin)
        x = x + self.proj(self.attn(q, k, v.reshape(shape), step))
        h = self.norm2(x)
        if self.gated:
            return x + self.down_proj(self.act(self.gate_up_proj(h)))
        return x + self.fc2(self.act(self.fc1(h)))


class PatchMerger(nn.Module):
    def __init__(self, context_dim: int, out_dim: int, merge: int, qwen25: bool, ctx: LayerContext) -> None:
        super().__init__()
        self.width = context_dim * merge * merge
        self.ln_q = RMSNorm(context_dim, 1e-6, ctx) if qwen25 else LayerNorm(context_dim, 1e-6, ctx)
        self.fc1 = ColumnParallelLinear(self.width, self.width, True, ctx, "visual.merger.mlp.0")
        self.act = Activation("gelu")
        self.fc2 = RowParallelLinear(self.width, out_dim, True, ctx, "visual.merger.mlp.2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.ln_q(x).reshape(-1, self.width))))


class VisionTransformer(nn.Module):
    def __init__(self, vc: Mapping[str, Any], qwen25: bool, ctx: LayerContext) -> None:
        super().__init__()
        self.qwen25 = qwen25
        dim = int(vc["hidden_size"] if qwen25 else vc["embed_dim"])
        out_dim = int(vc["out_hidden_size"] if qwen25 else vc["hidden_size"])
        self.patch = int(vc.get("patch_size", 14))
        self.temporal = int(vc.get("temporal_patch_size", 2))
        self.merge = int(vc.get("spatial_merge_size", 2))
        self.window = int(vc.get("window_size", 112))
        self.full_blocks = frozenset(int(i) for i in vc.get("fullatt_block_indexes", ()))
        self.dim = dim
        in_ch = int(vc.get("in_channels", 3))
        # the Conv3d's weight, applied as the matmul it is (stride = kernel)
        self.patch_embed = nn.Conv3d(in_ch, dim, (self.temporal, self.patch, self.patch),
                                     stride=(self.temporal, self.patch, self.patch), bias=False, dtype=ctx.dtype)
        theta = float((vc.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.rotary = VisionRotary(dim // int(vc["num_heads"]), theta)
        depth = int(vc["depth"])
        self.blocks = nn.ModuleList(VisionBlock(vc, qwen25, dim, i, ctx, f"visual.blocks.{i}") for i in range(depth))
        self.merger = PatchMerger(dim, out_dim, self.merge, qwen25, ctx)
        self.backend = ctx.attention_backend(VISION)

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """patches: [num_patches, 3 * t * p * p] -> merged embeddings [num_patches / merge^2, out_dim]."""
        weight = self.patch_embed.weight
        x = patches.to(weight.dtype) @ weight.reshape(self.dim, -1).t()
        cos, sin = self.rotary(vision_positions(grids, self.merge).to(x.device))
        full = encoder_step(self.backend, [t * h * w for t, h, w in grids])
        windowed = None
        unit = self.merge * self.merge
        if self.qwen25:
            order, lengths = window_order(grids, self.merge, self.window, self.patch)
            order = order.to(x.device)
            windowed = encoder_step(self.backend, lengths)

            def by_window(t):
                return t.reshape(-1, unit, t.shape[-1])[order].reshape(-1, t.shape[-1])

            x, cos, sin = by_window(x), by_window(cos), by_window(sin)
        for i, block in enumerate(self.blocks):
            step = full if windowed is None or i in self.full_blocks else windowed
            x = block(x, cos, sin, step)
        merged = self.merger(x)
        if self.qwen25:
            merged = merged[torch.argsort(order)]
        return merged


def rope_positions_for(token_count: int, features: Sequence[MultiModalFeature], merge: int) -> tuple[np.ndarray, int]:
    """Qwen2-VL's M-RoPE positions of a prompt ([3, token_count] int64) and the shift of the
    tokens after it (position = index + shift), as transformers' get_rope_index."""
    out = np.empty((3, token_count), dtype=np.int64)
    current = 0  # next position
    cursor = 0  # next token index
    for f in sorted(features, key=lambda f: f.offset):
        n_text = f.offset - cursor
        out[:, cursor : f.offset] = np.arange(current, current + n_text)
        current += n_text
        t, h, w = f.grid_thw
        gh, gw = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[0, f.offset : f.end] = tt.reshape(-1) + current
        out[1, f.offset : f.end] = hh.reshape(-1) + current
        out[2, f.offset : f.end] = ww.reshape(-1) + current
        current += max(h, w) // merge
        cursor = f.end
    out[:, cursor:] = np.arange(current, current + token_count - cursor)
    current += token_count - cursor
    return out, current - token_count


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    qwen25 = False

    @classmethod
    def lora_modules(cls, hf_config):
        # not yet: adapters name the language model's modules in two layouts here, and the
        # vision tower has projections of the same names
        return None

    @classmethod
    def decoder_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        text = _text_config(hf_config)
        layer_types, window = windowed_layer_types(text)
        return DecoderConfig.from_hf(text, default_max_position_embeddings=32768, qkv_bias=True,
                                     layer_types=layer_types, sliding_window=window)

    @classmethod
    def attention_specs(cls, hf_config, dtype: torch.dtype, kv_cache_dtype: str) -> dict[str, AttentionSpec]:
        specs = super().attention_specs(hf_config, dtype, kv_cache_dtype)
        vc = hf_config["vision_config"]
        heads = int(vc["num_heads"])
        head_dim = int(vc["hidden_size"] if cls.qwen25 else vc["embed_dim"]) // heads
        specs[VISION] = AttentionSpec(num_heads=heads, num_kv_heads=heads, head_size=head_dim, scale=head_dim**-0.5,
                                      dtype=dtype, kv_cache_dtype=kv_cache_dtype, causal=False)
        return specs

    @classmethod
    def multimodal_processor(cls, hf_config: Mapping[str, Any], model_path: str | Path) -> ImagePromptProcessor:
        vc = hf_config["vision_config"]
        merge = int(vc.get("spatial_merge_size", 2))
        cfg = dict(read_processor_config(model_path))
        cfg.setdefault("patch_size", int(vc.get("patch_size", 14)))
        cfg.setdefault("temporal_patch_size", int(vc.get("temporal_patch_size", 2)))
        cfg.setdefault("merge_size", merge)
        processor = build_image_processor(cfg, "Qwen2VLImageProcessor")
        return ImagePromptProcessor(
            image_processor=processor,
            placeholder_token_id=int(hf_config.get("image_token_id", 151655)),
            num_tokens=lambda processed: int(np.prod(processed.grid_thw)) // (merge * merge),
            key=f"{cls.__name__}:{sorted(cfg.items())!r}",
        )

    @classmethod
    def build(cls, hf_config, ctx: LayerContext):
        model = cls(cls.decoder_config(hf_config), ctx)
        model.visual = VisionTransformer(hf_config["vision_config"], cls.qwen25, ctx)
        model.mrope_section = mrope_section(hf_config)
        return model

    def embed_multimodal(self, features: Sequence[MultiModalFeature]) -> list[torch.Tensor]:
        device = self.visual.patch_embed.weight.device
        patches = torch.cat([torch.from_numpy(f.pixels().copy()) for f in features]).to(device)
        merged = self.visual(patches, [tuple(f.grid_thw) for f in features])
        return list(merged.split([f.length for f in features]))

    def rope_positions(self, num_prompt_tokens: int, features: Sequence[MultiModalFeature]) -> tuple[np.ndarray, int]:
        """The prompt's [3, n] positions and the position shift of the tokens after it (contract 1.4)."""
        return rope_positions_for(num_prompt_tokens, features, self.visual.merge)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
        hidden = self.model.embed(input_ids, step)
        rope = self.model.rotary_emb.prepare_mrope(positions, self.mrope_section) if positions.dim() == 2 else None
        return self.model.decode(hidden, positions, step, rope)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, _split_vision_qkv(weights), LLAMA_STACKED, self._vl_name)

    def _vl_name(self, name: str) -> str | None:
        if name.startswith("model.language_model."):  # transformers 5's in-memory layout
            name = "model." + name[len("model.language_model."):]
        elif name.startswith("model.visual."):
            name = name[len("model."):]
        if name.startswith("visual."):
            name = name.replace(".attn.qkv_split_", ".").replace(".attn.proj.", ".proj.")
            name = name.replace(".mlp.gate_proj.", ".gate_proj.").replace(".mlp.up_proj.", ".up_proj.")
            name = name.replace(".mlp.down_proj.", ".down_proj.").replace(".mlp.fc1.", ".fc1.").replace(".mlp.fc2.", ".fc2.")
            name = name.replace("merger.mlp.0.", "merger.fc1.").replace("merger.mlp.2.", "merger.fc2.")
            return name.replace("patch_embed.proj.", "patch_embed.")
        return self._checkpoint_name(name)


def _split_vision_qkv(weights: Iterable[tuple[str, torch.Tensor]]):
    """The vision blocks store q, k and v as one `attn.qkv` tensor: yield them as the three
    shards the fused parameter loads (`q_proj` / `k_proj` / `v_proj`)."""
    for name, tensor in weights:
        if ".attn.qkv." in name and "visual." in name:
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                yield name.replace(".attn.qkv.", f".attn.qkv_split_{part}."), chunk
        else:
            yield name, tensor


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    qwen25 = True
