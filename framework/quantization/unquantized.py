"""The default QuantMethod: weights kept in the model dtype, one plain matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..interfaces import QuantMethod


class UnquantizedMethod(QuantMethod):
    """`y = x @ W^T + b` with W in the activation dtype; runs on every platform."""

    name = "none"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype, bias: bool) -> None:
        # weight: [output_size, input_size], the checkpoint's own layout
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False) if bias else None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
