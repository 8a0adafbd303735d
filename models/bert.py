"""BERT-family encoders for embeddings (`BertModel`), with sentence-transformers pooling.

A post-norm encoder: word + position + token-type embeddings and a LayerNorm, then per
layer bidirectional self-attention and a GELU MLP, each followed by residual add and
LayerNorm. Attention goes through the plan's backend in encoder mode (no KV cache).

`pool(hidden, step)` reduces each sequence's hidden states the way the checkpoint's
sentence-transformers folder declares (`modules.json`, `1_Pooling/config.json`:
mean / cls / last / max; a `Normalize` module L2-normalizes); a plain BERT folder
without one gets CLS pooling, normalized.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from portaserve.framework.errors import UnsupportedError
from portaserve.framework.interfaces import AttentionSpec, ModelArchitecture
from portaserve.framework.layer_context import LayerContext, StepContext

from .layers.activation import Activation
from .layers.attention import Attention
from .layers.embedding import VocabParallelEmbedding
from .layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from .layers.loading import load_checkpoint
from .layers.norm import LayerNorm

ENCODER = "encoder"
POOLING_MODES = ("cls", "mean", "last", "max")
DEFAULT_POOLING = {"mode": "cls", "normalize": True}

BERT_STACKED = (("qkv_proj", "query", "q"), ("qkv_proj", "key", "k"), ("qkv_proj", "value", "v"))
# Checkpoint tensors that are not part of the encoder: heads and saved index buffers.
_SKIPPED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids", "embeddings.token_type_ids")


class BertEmbeddings(nn.Module):
    def __init__(self, hf: Mapping[str, Any], ctx: LayerContext) -> None:
        super().__init__()
        hidden = int(hf["hidden_size"])
        self.word_embeddings = VocabParallelEmbedding(int(hf["vocab_size"]), hidden, ctx, "embeddings.word_embeddings")
        # position and token-type tables are small: replicated on every rank
        self.position_embeddings = nn.Embedding(int(hf.get("max_position_embeddings", 512)), hidden, dtype=ctx.dtype)
        self.token_type_embeddings = nn.Embedding(int(hf.get("type_vocab_size", 2)), hidden, dtype=ctx.dtype)
        self.LayerNorm = LayerNorm(hidden, float(hf.get("layer_norm_eps", 1e-12)), ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # every token has token type 0 (single-segment inputs)
        token_type = self.token_type_embeddings.weight[0]
        x = self.word_embeddings(input_ids) + token_type + self.position_embeddings(positions)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, hf: Mapping[str, Any], layer_idx: int, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        hidden = int(hf["hidden_size"])
        num_heads = int(hf["num_attention_heads"])
        self.head_dim = hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_heads, True, ctx, f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.q_size = self.qkv_proj.q_size
        self.attn = Attention(self.num_heads, self.qkv_proj.num_kv_heads_per_rank, self.head_dim, layer_idx, ENCODER, ctx)

    def forward(self, hidden: torch.Tensor, step: StepContext) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        # q, k, v: [num_tokens, num_heads_per_rank, head_dim]
        shape = (n, -1, self.head_dim)
        return self.attn(q.reshape(shape), k.reshape(shape), v.reshape(shape), step)


class BertSelfOutput(nn.Module):
    """dense + residual + LayerNorm (after attention, and after the MLP as BertOutput)."""

    def __init__(self, input_size: int, hf: Mapping[str, Any], ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        hidden = int(hf["hidden_size"])
        self.dense = RowParallelLinear(input_size, hidden, True, ctx, f"{prefix}.dense")
        self.LayerNorm = LayerNorm(hidden, float(hf.get("layer_norm_eps", 1e-12)), ctx)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, hf: Mapping[str, Any], layer_idx: int, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        self.self = BertSelfAttention(hf, layer_idx, ctx, f"{prefix}.self")
        self.output = BertSelfOutput(int(hf["hidden_size"]), hf, ctx, f"{prefix}.output")

    def forward(self, hidden: torch.Tensor, step: StepContext) -> torch.Tensor:
        return self.output(self.self(hidden, step), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, hf: Mapping[str, Any], ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(int(hf["hidden_size"]), int(hf["intermediate_size"]), True, ctx, f"{prefix}.dense")
        self.act = Activation(str(hf.get("hidden_act", "gelu")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, hf: Mapping[str, Any], layer_idx: int, ctx: LayerContext, prefix: str) -> None:
        super().__init__()
        self.attention = BertAttention(hf, layer_idx, ctx, f"{prefix}.attention")
        self.intermediate = BertIntermediate(hf, ctx, f"{prefix}.intermediate")
        self.output = BertSelfOutput(int(hf["intermediate_size"]), hf, ctx, f"{prefix}.output")

    def forward(self, hidden: torch.Tensor, step: StepContext) -> torch.Tensor:
        hidden = self.attention(hidden, step)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, hf: Mapping[str, Any], ctx: LayerContext) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            BertLayer(hf, i, ctx, f"encoder.layer.{i}") for i in range(int(hf["num_hidden_layers"]))
        )

    def forward(self, hidden: torch.Tensor, step: StepContext) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden, step)
        return hidden


def pooling_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The folder's declared pooling (see `portaserve.framework.checkpoint.load_hf_config`)."""
    pooling = dict(hf_config.get("portaserve_pooling") or DEFAULT_POOLING)
    if pooling.get("mode") not in POOLING_MODES:
        raise UnsupportedError(f"pooling: mode {pooling.get('mode')!r} is not supported; supported: {', '.join(POOLING_MODES)}")
    return pooling


class BertModel(ModelArchitecture):
    """BERT encoder producing one embedding per sequence."""

    is_pooling = True

    @classmethod
    def attention_specs(cls, hf_config, dtype: torch.dtype, kv_cache_dtype: str) -> dict[str, AttentionSpec]:
        num_heads = int(hf_config["num_attention_heads"])
        head_dim = int(hf_config["hidden_size"]) // num_heads
        spec = AttentionSpec(
            num_heads=num_heads,
            num_kv_heads=num_heads,
            head_size=head_dim,
            scale=head_dim**-0.5,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            causal=False,
        )
        return {ENCODER: spec}

    @classmethod
    def attention_layer_types(cls, hf_config) -> list[str]:
        return []  # bidirectional, no KV cache

    @classmethod
    def max_model_len(cls, hf_config) -> int:
        return int(hf_config.get("max_position_embeddings", 512))

    @classmethod
    def build(cls, hf_config, ctx: LayerContext) -> "BertModel":
        return cls(hf_config, ctx)

    def __init__(self, hf_config: Mapping[str, Any], ctx: LayerContext) -> None:
        super().__init__()
        self.pooling = pooling_config(hf_config)
        self.embeddings = BertEmbeddings(hf_config, ctx)
        self.encoder = BertEncoder(hf_config, ctx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden: [num_tokens, hidden_size]."""
        return self.encoder(self.embeddings(input_ids, positions), step)

    def pool(self, hidden: torch.Tensor, step: StepContext) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size] -> float32 embeddings [num_seqs, hidden_size]."""
        qsl = step.query_start_loc
        if qsl is None:
            qsl = torch.tensor([0, hidden.shape[0]])
        qsl = qsl.to(device=hidden.device, dtype=torch.int64)
        starts, ends = qsl[:-1], qsl[1:]
        lengths = ends - starts
        mode = self.pooling["mode"]
        if mode == "cls":
            pooled = hidden.index_select(0, starts).float()
        elif mode == "last":
            pooled = hidden.index_select(0, (ends - 1).clamp(min=0)).float()
        else:
            seq_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=hidden.device), lengths)
            rows = hidden.float()
            if mode == "mean":
                sums = torch.zeros(lengths.numel(), hidden.shape[1], device=hidden.device).index_add_(0, seq_of_token, rows)
                pooled = sums / lengths.clamp(min=1).unsqueeze(1).float()
            else:  # max
                init = torch.full((lengths.numel(), hidden.shape[1]), float("-inf"), device=hidden.device)
                pooled = init.scatter_reduce(0, seq_of_token.unsqueeze(1).expand_as(rows), rows, reduce="amax")
        if self.pooling.get("normalize"):
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, weights, BERT_STACKED, _checkpoint_name)


def _checkpoint_name(name: str) -> str | None:
    name = name.removeprefix("bert.")
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    # TF-era checkpoints call LayerNorm's parameters gamma and beta
    if name.endswith(".gamma"):
        return name[: -len(".gamma")] + ".weight"
    if name.endswith(".beta"):
        return name[: -len(".beta")] + ".bias"
    return name
