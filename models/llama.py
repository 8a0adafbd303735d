"""Llama: the pre-norm decoder with RoPE, grouped-query attention and a gated SiLU MLP.

Qwen2, Qwen3 and Mistral are this decoder with different flags (qkv bias, q/k norm,
sliding windows) and config defaults; their files subclass `LlamaForCausalLM` and
override `decoder_config`.

Parameter names match transformers' checkpoints except the fused projections:
`self_attn.qkv_proj` holds q_proj/k_proj/v_proj and `mlp.gate_up_proj` holds
gate_proj/up_proj, loaded shard by shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from portaserve.framework.interfaces import AttentionSpec, ModelArchitecture
from portaserve.framework.layer_context import LayerContext, StepContext

from .layers.activation import ActAndMul, SiluAndMul
from .layers.attention import Attention
from .layers.embedding import ParallelLMHead, VocabParallelEmbedding
from .layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from .layers.loading import LLAMA_STACKED, load_checkpoint
from .layers.norm import RMSNorm
from .layers.rotary import RotaryEmbedding, rope_max_positions, rope_parameters

FULL = "full"
SLIDING = "sliding"


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """What the decoder needs from config.json, with the family's defaults applied."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: Mapping[str, Any]
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    #: one of FULL / SLIDING per layer
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], *, default_num_kv_heads: int | None = None, default_head_dim: int | None = None,
                default_max_position_embeddings: int = 2048, **flags: Any) -> "DecoderConfig":
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        num_kv = hf.get("num_key_value_heads") or default_num_kv_heads or num_heads
        head_dim = hf.get("head_dim") or default_head_dim or hidden // num_heads
        num_layers = int(hf["num_hidden_layers"])
        flags.setdefault("layer_types", (FULL,) * num_layers)
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(num_kv),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", default_max_position_embeddings)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope=rope_parameters(hf),
            hidden_act=str(hf.get("hidden_act", "silu")),
            **flags,
        )


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused into one column-parallel matmul."""

    def __init__(self, cfg: DecoderConfig, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias, ctx, f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, ctx, f"{prefix}.down_proj")
        if cfg.hidden_act in ("silu", "swish"):
            self.act_fn = SiluAndMul(ctx)
        else:
            self.act_fn = ActAndMul(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden] -> gate_up: [num_tokens, 2 * intermediate_per_rank]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderAttention(nn.Module):
    """Self-attention of one layer: fused qkv projection, optional per-head q/k RMSNorm
    (Qwen3), RoPE, the paged attention backend, output projection."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int, rotary: RotaryEmbedding, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, ctx, f"{prefix}.qkv_proj"
        )
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_rank
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, ctx, f"{prefix}.o_proj")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ctx)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ctx)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, layer_idx, cfg.layer_types[layer_idx], ctx)

    def forward(self, rope, hidden: torch.Tensor, step: StepContext) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary_emb(rope, q, k)
        out = self.attn(q, k, v, step)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int, rotary: RotaryEmbedding, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(cfg, layer_idx, rotary, ctx, f"{prefix}.self_attn")
        self.mlp = GatedMLP(cfg, ctx, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)

    def forward(self, rope, hidden: torch.Tensor, residual: torch.Tensor | None, step: StepContext):
        # The residual stream is carried separately so each norm can fuse the add before it.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, step)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, the decoder layers, the final norm (transformers' `model.` prefix)."""

    def __init__(self, cfg: DecoderConfig, ctx: LayerContext) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, "model.embed_tokens")
        rotary_dim = int(cfg.head_dim * float(cfg.rope.get("partial_rotary_factor") or 1.0))
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, rotary_dim, cfg.max_position_embeddings, cfg.rope, ctx)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rotary_emb, ctx, f"model.layers.{i}") for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
        return self.decode(self.embed_tokens(input_ids), positions, step)

    def embed(self, input_ids: torch.Tensor, step: StepContext) -> torch.Tensor:
        """Token embeddings, with the step's image embeddings (`step.mm_embeds`) in their rows."""
        hidden = self.embed_tokens(input_ids)
        mm = getattr(step, "mm_embeds", None)
        if mm is not None:
            rows, values = mm
            hidden = hidden.index_copy(0, rows, values.to(hidden.dtype))
        return hidden

    def decode(self, hidden: torch.Tensor, positions: torch.Tensor, step: StepContext, rope=None) -> torch.Tensor:
        """The layers and the final norm over input embeddings [num_tokens, hidden]
        (vision-language models replace some rows before this, and may bring their own
        `rope`: multimodal positions)."""
        if rope is None:
            rope = self.rotary_emb.prepare(positions, step)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, step)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(ModelArchitecture):
    """Llama 2/3 (and any checkpoint of the same layout): rope_scaling default, linear,
    dynamic, llama3 and yarn; attention_bias / mlp_bias; head_dim from config; tied or
    untied embeddings."""

    is_pooling = False

    @classmethod
    def decoder_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        """config.json -> DecoderConfig with this family's defaults (transformers' LlamaConfig)."""
        bias = bool(hf_config.get("attention_bias", False))
        return DecoderConfig.from_hf(
            hf_config, qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf_config.get("mlp_bias", False))
        )

    @classmethod
    def lora_modules(cls, hf_config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
        cfg = cls.decoder_config(hf_config)
        h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
                  "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
                  "mlp.down_proj": (inter, h)}
        return {f"model.layers.{i}.{name}": shape for i in range(cfg.num_layers) for name, shape in shapes.items()}

    @classmethod
    def attention_specs(cls, hf_config, dtype: torch.dtype, kv_cache_dtype: str) -> dict[str, AttentionSpec]:
        cfg = cls.decoder_config(hf_config)
        specs = {}
        for layer_type in dict.fromkeys(cfg.layer_types):
            specs[layer_type] = AttentionSpec(
                num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads,
                head_size=cfg.head_dim,
                scale=cfg.head_dim**-0.5,
                dtype=dtype,
                kv_cache_dtype=kv_cache_dtype,
                sliding_window=cfg.sliding_window if layer_type == SLIDING else None,
            )
        return specs

    @classmethod
    def attention_layer_types(cls, hf_config) -> list[str]:
        return list(cls.decoder_config(hf_config).layer_types)

    @classmethod
    def max_model_len(cls, hf_config) -> int:
        cfg = cls.decoder_config(hf_config)
        return rope_max_positions(cfg.rope, cfg.max_position_embeddings)

    @classmethod
    def build(cls, hf_config, ctx: LayerContext) -> "LlamaForCausalLM":
        return cls(cls.decoder_config(hf_config), ctx)

    def __init__(self, cfg: DecoderConfig, ctx: LayerContext) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, ctx)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx, "lm_head")
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden: [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, step)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_selected, hidden_size] -> float32 logits [num_selected, vocab_size]."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, weights, LLAMA_STACKED, self._checkpoint_name)

    def _checkpoint_name(self, name: str) -> str | None:
        # Older checkpoints saved the RoPE tables; they are recomputed here.
        if "rotary_emb." in name:
            return None
        # A tied checkpoint may still carry a copy of the embedding as the LM head.
        # (its scales too, where a quantized file stores them beside the codes)
        if name.startswith("lm_head.weight") and self.config.tie_word_embeddings:
            return None
        return name
