"""The "int8" QuantMethod: int8 weights, per-output-channel symmetric scales, float activations.

`y = (x @ q^T) * s (+ b)`, where `q = round(W / s)` in [-127, 127] and `s = max|W_row| / 127`
(one scale per output channel, so an outlier row does not coarsen the others). Online
(`--quantization int8`) the layer first loads the checkpoint's float weight, then
quantizes it once after loading; pre-quantized (compressed-tensors W8A16) it loads the
int8 `weight` and the `weight_scale` directly. The matmul itself is a device's kernel
from `int8_kernels`, chosen by the platform's declared features.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from portaserve.framework.interfaces import QuantMethod

from .int8_kernels import Int8Kernel, choose_int8_kernel

INT8_MAX = 127


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization.

    :param weight: [out_features, in_features], any float dtype.
    :returns: (q [out, in] int8, scale [out] float32) with weight ~= q * scale[:, None].
    """
    w = weight.float()
    # a zero row gets scale 1 (any scale reproduces it) instead of a division by zero
    scale = w.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q: [out, in] int8, scale: [out] -> float32 [out, in]."""
    return q.float() * scale.float().reshape(-1, 1)


class Int8WeightOnlyMethod(QuantMethod):
    """Weight-only int8 for every linear layer (the LM head and embeddings stay in the model dtype)."""

    name = "int8"
    # per-channel int8 weights: 0.6-0.8% relative error against the float matmul on the
    # kit's random inputs; the budget leaves room for bf16 activations
    conformance_tolerance = 2e-2
    #: A fast kernel needs one of these: torch's CPU int8 weight-pack kernel ("int8_matmul"
    #: on the CPU platform) or the Triton kernel ("triton", GPU platforms).
    accepted_features: ClassVar[frozenset[str]] = frozenset({"int8_matmul", "triton"})

    def __init__(self, config: dict | None = None, *, prequantized: bool = False) -> None:
        super().__init__(config)
        self.prequantized = prequantized
        self.prefix = ""  # the layer's name; the LayerContext sets it
        self.kernel: Int8Kernel | None = None

    @classmethod
    def unsupported_reason(cls, features: frozenset[str], act_dtype: torch.dtype, config: Mapping[str, Any]) -> str | None:
        if not features & cls.accepted_features:
            return f"needs one of the platform features {sorted(cls.accepted_features)}"
        return super().unsupported_reason(features, act_dtype, config)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype, bias: bool) -> None:
        layer.act_dtype = params_dtype
        if self.prequantized:
            # weight: [out, in] int8; weight_scale: [out, 1], compressed-tensors' channel layout
            layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=torch.int8), requires_grad=False)
            scale = nn.Parameter(torch.empty(output_size, 1, dtype=torch.float32), requires_grad=False)
            scale.output_dim = 0  # sharded with the output rows; replicated by row-parallel layers
            layer.weight_scale = scale
        else:
            # the checkpoint's float weight, quantized in process_weights_after_loading
            layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False) if bias else None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.prequantized:
            q, scale = layer.weight.data, layer.weight_scale.data.reshape(-1).float()
        else:
            q, scale = quantize_int8_per_channel(layer.weight.data)
        # the loader's tags (weight_loader, output_dim, ...) move to the new parameters, so a
        # live weight update loads through them as the checkpoint did
        tags = {n: dict(vars(getattr(layer, n))) for n in ("weight", "weight_scale") if hasattr(layer, n)}
        del layer.weight  # frees the float weight before the kernel's copy exists
        if hasattr(layer, "weight_scale"):
            del layer.weight_scale
        self.kernel = choose_int8_kernel(self.platform_features, layer.act_dtype, q.shape[1])
        self.kernel.prepare(layer, q, scale)
        for n, attrs in tags.items():
            vars(getattr(layer, n)).update(attrs)
        if not self.prequantized:
            # computed here, not read from the checkpoint (a weight update requantizes)
            layer.weight_scale.derived_after_loading = True

    def checkpoint_layout(self, layer: nn.Module, param_name: str) -> torch.Tensor | None:
        if self.kernel is None:
            return None  # not processed yet: still the checkpoint's layout
        if param_name == "weight" and not self.prequantized:
            # online: the checkpoint holds float weights; requantized after the update
            return dequantize_int8(layer.weight.data, layer.weight_scale.data).to(layer.act_dtype)
        if param_name == "weight_scale" and self.prequantized:
            return layer.weight_scale.data.float().reshape(-1, 1)  # compressed-tensors' [out, 1]
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel is None:
            raise RuntimeError(f"{self.prefix}: int8 weights used before process_weights_after_loading")
        # x: [..., in] -> x2: [num_tokens, in]
        x2 = x.reshape(-1, x.shape[-1])
        y = self.kernel.matmul(layer, x2, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])
