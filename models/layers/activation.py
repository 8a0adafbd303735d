"""Activations: the gated MLP's SiLU-and-mul (a fusable op) and the encoders' GELU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from portaserve.framework.errors import UnsupportedError
from portaserve.framework.layer_context import LayerContext


class SiluAndMul(nn.Module):
    """`silu(x[..., :d]) * x[..., d:]` for x: [..., 2 * d] (the fused gate_up output).

    Calls the plan's `silu_and_mul` op (the platform's kernel or the torch reference).
    """

    def __init__(self, ctx: LayerContext) -> None:
        super().__init__()
        self._op = ctx.ops.get("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# config.json `hidden_act` -> elementwise function (transformers' ACT2FN names)
_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
}


def get_activation(name: str):
    """The elementwise activation called `name` in config.json's `hidden_act`."""
    fn = _ACTIVATIONS.get(name)
    if fn is None:
        raise UnsupportedError(f"hidden_act: {name!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return fn


class ActAndMul(nn.Module):
    """`act(x[..., :d]) * x[..., d:]` for gated MLPs whose activation is not SiLU."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._fn = get_activation(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self._fn(gate) * up


class Activation(nn.Module):
    """An elementwise activation by config name (GELU for BERT)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._fn = get_activation(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x)

    def extra_repr(self) -> str:
        return self.name


__all__ = ["ActAndMul", "Activation", "SiluAndMul", "get_activation"]
