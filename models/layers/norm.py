"""RMSNorm (with the decoder's fused residual add) and LayerNorm.

RMSNorm calls the `rms_norm` / `fused_add_rms_norm` ops the plan bound: the platform's
fused kernel, or the torch reference, which computes like transformers (normalize in
float32, round to the activation dtype, then scale by the weight in the weight's dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from portaserve.framework.layer_context import LayerContext


class RMSNorm(nn.Module):
    """`out = x / sqrt(mean(x^2) + eps) * weight` over the last dim.

    `forward(x, residual)` first adds the residual and returns (out, new_residual), the
    pre-norm decoder's pattern, so a fused kernel can do both in one pass.
    """

    def __init__(self, hidden_size: int, eps: float, ctx: LayerContext) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=ctx.dtype), requires_grad=False)
        self._rms_norm = ctx.ops.get("rms_norm")
        self._fused_add_rms_norm = ctx.ops.get("fused_add_rms_norm")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x, residual: [..., hidden_size]
        if residual is None:
            return self._rms_norm(x, self.weight, self.eps)
        return self._fused_add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class LayerNorm(nn.Module):
    """Standard LayerNorm with weight and bias (BERT-family encoders)."""

    def __init__(self, hidden_size: int, eps: float, ctx: LayerContext) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=ctx.dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size, dtype=ctx.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
