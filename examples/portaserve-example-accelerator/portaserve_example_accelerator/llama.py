"""nova's own Llama: registered for platform nova only (``portaserve_platform_model_architectures``).

Written in plain torch against the model contract, nothing of portaserve's models:

- ``build(hf_config, ctx)`` constructs the module; the context gives each linear layer
  its QuantMethod (``ctx.quant_method(prefix)``), the attention layers their backend
  (``ctx.attention_backend(layer_type)``), every op its bound implementation
  (``ctx.ops.get(name)``), plus ``ctx.dtype``, ``ctx.device``, ``ctx.tp_rank``,
  ``ctx.tp_size`` and ``ctx.communicator``;
- ``forward(input_ids, positions, step)`` reads the step's per-layer-type attention
  metadata (``step.attn_metadata``) and each attention layer's KV-cache tensor
  (``step.kv_caches[layer_idx]``);
- ``load_weights`` takes the checkpoint's HF-named tensors and copies each through its
  parameter's ``weight_loader`` (which a weight update wraps to stage the new values),
  raising ``InvalidParameterError`` for tensors it cannot place or parameters left unloaded;
- ``attention_specs`` / ``attention_layer_types`` / ``max_model_len`` read config.json
  before anything is built, and reject what this implementation does not support
  (plan time, before any weight loads).

What nova's version does differently from the generic one: q/k/v come out of one fused
projection and go through the op ``split_qkv_rope`` (declared by this plugin), and the
MLP's activation is the op ``silu_and_mul`` (bound to nova's implementation). Tensor
parallelism: query and KV heads split across ranks (KV heads must divide evenly), the
MLP split Megatron-style, embedding and LM head replicated.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from portaserve.framework.errors import UnsupportedError, invalid
from portaserve.framework.interfaces import AttentionSpec, ModelArchitecture

LAYER_TYPE = "full"
SUPPORTED_ROPE_TYPES = ("default", "linear")

# checkpoint part -> (fused parameter part, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_linear_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "LlamaConfig":
        """config.json -> LlamaConfig; UnsupportedError for what nova's Llama does not implement."""
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedError(f"model: nova's LlamaForCausalLM supports hidden_act silu, not {act!r}")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedError(
                f"model: nova's LlamaForCausalLM supports rope types {', '.join(SUPPORTED_ROPE_TYPES)}, "
                f"not {rope_type!r}"
            )
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        partial = float(rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0)
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta") or hf.get("rope_theta", 10000.0)),
            rope_linear_factor=float(rope.get("factor") or 1.0) if rope_type == "linear" else 1.0,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
        )

    @property
    def max_positions(self) -> int:
        return int(self.max_position_embeddings * self.rope_linear_factor)


# ----- weight loading helpers ----------------------------------------------------------


def _copy(target: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
    target.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
    """A replicated parameter: copied whole (the dtype converts)."""
    _copy(param.data, loaded)


class NovaLinear(nn.Module):
    """A linear layer whose weights and matmul come from ``ctx.quant_method(prefix)``.

    :param parallel: "column" (outputs split across tensor-parallel ranks: each entry of
        `output_sizes`, a fused part, is split on its own), "row" (inputs split; partial
        sums all-reduced, the bias added once after), or None (replicated).
    """

    def __init__(self, ctx, prefix: str, input_size: int, output_sizes: list[int], parallel: str | None,
                 bias: bool = False, unquantized: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = (ctx.tp_rank, ctx.tp_size) if parallel else (0, 1)
        for size in (output_sizes if parallel == "column" else [input_size] if parallel == "row" else []):
            if size % self.tp_size:
                raise UnsupportedError(f"{prefix}: size {size} is not divisible by tensor_parallel_size {self.tp_size}")
        self.parallel = parallel
        self.parts = [s // self.tp_size for s in output_sizes] if parallel == "column" else list(output_sizes)
        self.input_size_per_rank = input_size // self.tp_size if parallel == "row" else input_size
        self.communicator = ctx.communicator
        self.quant_method = ctx.quant_method(prefix, unquantized=unquantized)
        self.quant_method.create_weights(self, self.input_size_per_rank, sum(self.parts), ctx.dtype, bias)
        if not hasattr(self, "bias"):
            self.bias = None
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def _dims(self, param: torch.Tensor) -> tuple[int | None, int | None]:
        """(output dim, input dim) of a parameter: the QuantMethod's tags, else [out, in] / [out]."""
        if hasattr(param, "output_dim") or hasattr(param, "input_dim"):
            return getattr(param, "output_dim", None), getattr(param, "input_dim", None)
        if param.dim() == 2:
            return 0, 1
        return (0, None) if param.dim() == 1 else (None, None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        """Copy this rank's part of the full checkpoint tensor `loaded` (fused part `shard`) into `param`."""
        out_dim, in_dim = self._dims(param)
        target = param.data
        if shard is not None and out_dim is not None:
            size = self.parts[shard]
            target = target.narrow(out_dim, sum(self.parts[:shard]), size)
        if self.parallel == "column" and out_dim is not None and loaded.dim() > 0:
            size = target.shape[out_dim]
            loaded = loaded.narrow(out_dim, self.tp_rank * size, size)
        elif self.parallel == "row" and in_dim is not None:
            size = target.shape[in_dim]
            loaded = loaded.narrow(in_dim, self.tp_rank * size, size)
        _copy(target, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, input_size_per_rank] -> [num_tokens, sum(parts)]
        if self.parallel != "row" or self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        y = self.communicator.all_reduce(self.quant_method.apply(self, x, None))
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ctx) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=ctx.dtype), requires_grad=False)
        self._rms_norm = ctx.ops.get("rms_norm")
        self._fused_add_rms_norm = ctx.ops.get("fused_add_rms_norm")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._rms_norm(x, self.weight, self.eps)
        return self._fused_add_rms_norm(x, residual, self.weight, self.eps)  # (out, x + residual)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int, ctx, prefix: str) -> None:
        super().__init__()
        tp = ctx.tp_size
        if cfg.num_heads % tp or cfg.num_kv_heads % tp:
            raise UnsupportedError(
                f"model: nova's LlamaForCausalLM splits heads evenly: {cfg.num_heads} query and "
                f"{cfg.num_kv_heads} KV heads do not divide by tensor_parallel_size {tp}"
            )
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.head_dim
        d = cfg.head_dim
        self.qkv_proj = NovaLinear(ctx, f"{prefix}.qkv_proj", cfg.hidden_size,
                                   [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], "column",
                                   bias=cfg.attention_bias)
        self.o_proj = NovaLinear(ctx, f"{prefix}.o_proj", cfg.num_heads * d, [cfg.hidden_size], "row", bias=cfg.attention_bias)
        self.backend = ctx.attention_backend(LAYER_TYPE)
        self._split_qkv_rope = ctx.ops.get("split_qkv_rope")

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, step) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        # q: [t, heads, d]; k, v: [t, kv_heads, d]
        q, k, v = self._split_qkv_rope(self.qkv_proj(hidden), positions, cos_sin_cache,
                                       self.num_heads, self.num_kv_heads, self.head_dim, True)
        out = self.backend.forward(q, k, v, step.kv_caches[self.layer_idx], step.attn_metadata[LAYER_TYPE])
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, ctx, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = NovaLinear(ctx, f"{prefix}.gate_up_proj", cfg.hidden_size, [cfg.intermediate_size] * 2,
                                       "column", bias=cfg.mlp_bias)
        self.down_proj = NovaLinear(ctx, f"{prefix}.down_proj", cfg.intermediate_size, [cfg.hidden_size], "row",
                                    bias=cfg.mlp_bias)
        self._silu_and_mul = ctx.ops.get("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int, ctx, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.self_attn = Attention(cfg, layer_idx, ctx, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.mlp = MLP(cfg, ctx, f"{prefix}.mlp")

    def forward(self, hidden, residual, positions, cos_sin_cache, step):
        # the residual stream is carried apart so that each norm fuses the add before it
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, cos_sin_cache, step)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Embedding(nn.Module):
    """The whole vocabulary on every rank (nova's Llama replicates it)."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self.weight)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, ctx) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, ctx)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ctx, f"model.layers.{i}") for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        # cos_sin_cache: [max_positions, rotary_dim] float32, cos then sin (split_qkv_rope's layout);
        # computed on the host in float32 as transformers does, so positions rotate identically
        with torch.device("cpu"):
            exponents = torch.arange(0, cfg.rotary_dim, 2, dtype=torch.int64).float() / cfg.rotary_dim
            inv_freq = 1.0 / (cfg.rope_theta**exponents) / cfg.rope_linear_factor
            freqs = torch.arange(cfg.max_positions).float().unsqueeze(-1) * inv_freq
            cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache.to(ctx.device), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, self.cos_sin_cache, step)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class NovaLlamaForCausalLM(ModelArchitecture):
    """Llama (rope default or linear, attention / MLP bias, tied or untied embeddings) on nova."""

    is_pooling = False

    @classmethod
    def unsupported_reason(cls, hf_config, tensor_parallel_size: int) -> str | None:
        """Asked by the plan before anything loads: a checkpoint this model cannot run goes
        to portaserve's generic Llama instead (the plan says why)."""
        try:
            cfg = LlamaConfig.from_hf(hf_config)
        except UnsupportedError as exc:
            return str(exc).removeprefix("model: ")
        if cfg.num_heads % tensor_parallel_size or cfg.num_kv_heads % tensor_parallel_size:
            return (f"nova's LlamaForCausalLM splits heads evenly: {cfg.num_heads} query and {cfg.num_kv_heads} KV "
                    f"heads do not divide by tensor_parallel_size {tensor_parallel_size}")
        return None

    @classmethod
    def attention_specs(cls, hf_config, dtype: torch.dtype, kv_cache_dtype: str) -> dict[str, AttentionSpec]:
        cfg = LlamaConfig.from_hf(hf_config)
        return {
            LAYER_TYPE: AttentionSpec(
                num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads,
                head_size=cfg.head_dim,
                scale=cfg.head_dim**-0.5,
                dtype=dtype,
                kv_cache_dtype=kv_cache_dtype,
            )
        }

    @classmethod
    def attention_layer_types(cls, hf_config) -> list[str]:
        return [LAYER_TYPE] * LlamaConfig.from_hf(hf_config).num_layers

    @classmethod
    def max_model_len(cls, hf_config) -> int:
        return LlamaConfig.from_hf(hf_config).max_positions

    @classmethod
    def build(cls, hf_config, ctx) -> "NovaLlamaForCausalLM":
        return cls(LlamaConfig.from_hf(hf_config), ctx)

    def __init__(self, cfg: LlamaConfig, ctx) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, ctx)
        # the LM head is never quantized: "none", or the platform's variant of it
        self.lm_head = NovaLinear(ctx, "lm_head", cfg.hidden_size, [cfg.vocab_size], None, unquantized=True)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden: [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, step)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_selected, hidden_size] -> float32 logits [num_selected, vocab_size]."""
        return self.lm_head.quant_method.apply(self.lm_head, hidden, None).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())  # a tied LM head appears once, as the embedding
        # every (parameter, shard) the checkpoint must fill; a tensor the QuantMethod derives
        # after loading (a scale) is not the checkpoint's to fill
        expected: set[tuple[str, int | None]] = set()
        for name, param in params.items():
            if getattr(param, "derived_after_loading", False):
                continue
            fused = next((f for f, _ in _FUSED.values() if f".{f}." in name), None)
            if fused is None:
                expected.add((name, None))
            else:
                expected.update((name, i) for part, (f, i) in _FUSED.items() if f == fused)
        filled: set[tuple[str, int | None]] = set()
        consumed: set[str] = set()
        unexpected: list[str] = []
        for ckpt_name, tensor in weights:
            if "rotary_emb." in ckpt_name or (ckpt_name == "lm_head.weight" and self.config.tie_word_embeddings):
                consumed.add(ckpt_name)  # recomputed / shared: skipped on purpose
                continue
            target, shard = ckpt_name, None
            for part, (fused, index) in _FUSED.items():
                if f".{part}." in ckpt_name:
                    target, shard = ckpt_name.replace(f".{part}.", f".{fused}.", 1), index
                    break
            param = params.get(target)
            if param is None:
                unexpected.append(ckpt_name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor) if shard is None else loader(param, tensor, shard)
            except ValueError as exc:
                raise invalid("model", f"checkpoint tensor {ckpt_name!r} does not fit parameter {target!r}: {exc}") from None
            filled.add((target, shard))
            consumed.add(ckpt_name)
        missing = sorted(f"{n}" + (f" (part {s})" if s is not None else "") for n, s in expected - filled)
        if unexpected or missing:
            raise invalid(
                "model",
                f"checkpoint does not match nova's LlamaForCausalLM: unexpected {unexpected[:8]}, missing {missing[:8]}",
            )
        return consumed
