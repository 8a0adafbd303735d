"""The attention layer: hands q, k, v to the plan's AttentionBackend for its layer type.

It projects nothing and rotates nothing (the model does both); it finds this layer's
KV-cache tensor (`step.kv_caches[layer_idx]`) and the step's metadata for its layer
type, and lets the backend write the new K/V and attend.
"""

from __future__ import annotations

import torch
from torch import nn

from portaserve.framework.layer_context import LayerContext, StepContext


class Attention(nn.Module):
    """One attention layer on this rank (its share of the heads)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        layer_idx: int,
        layer_type: str,
        ctx: LayerContext,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.layer_idx = layer_idx
        self.layer_type = layer_type
        self.backend = ctx.attention_backend(layer_type)
        spec = self.backend.spec
        if (spec.num_heads, spec.num_kv_heads, spec.head_size) != (num_heads, num_kv_heads, head_size):
            raise ValueError(
                f"attention layer {layer_idx} ({layer_type}) has {num_heads}/{num_kv_heads} heads of size "
                f"{head_size} on this rank, but its backend was built for {spec.num_heads}/{spec.num_kv_heads} "
                f"of size {spec.head_size}"
            )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepContext) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_size], k/v: [num_tokens, num_kv_heads, head_size]
        -> [num_tokens, num_heads * head_size]."""
        kv_cache = step.kv_caches[self.layer_idx] if self.backend.spec.uses_kv_cache else None
        out = self.backend.forward(q, k, v, kv_cache, step.attn_metadata[self.layer_type])
        return out.reshape(q.shape[0], self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return f"layer {self.layer_idx} ({self.layer_type}), heads={self.num_heads}/{self.num_kv_heads}x{self.head_size}"
