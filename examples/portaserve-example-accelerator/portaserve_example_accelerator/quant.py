"""``nova_int8``: weight-only int8 with one scale per output channel, for nova.

Online quantization (``--quantization nova_int8``): the layer loads the checkpoint's
float weight, `process_weights_after_loading` replaces it by ``q = round(W / s)`` in
[-127, 127] (int8) with ``s = max|W_row| / 127`` (float32, ``weight_scale``), and `apply`
computes ``x @ (q * s)^T (+ b)``, dequantizing in float32 and rounding once to the
activations' dtype. Gated by the platform feature ``nova_int8`` (declared by nova).

Loader conventions this method keeps (see the QuantMethod docstrings):
- the float ``weight`` it creates is ``[output_size, input_size]``, the checkpoint's layout,
  so the model's weight loaders shard it like an unquantized one;
- quantizing swaps the parameter's data in place, so the tags the model put on it
  (``weight_loader``, ...) stay;
- ``weight_scale`` exists only after loading: it is tagged ``derived_after_loading`` (a
  loader must not expect it in a checkpoint) and ``output_dim = 0``;
- `checkpoint_layout` gives the dequantized weight back, so a live weight update
  loads float tensors into it and calls `process_weights_after_loading` again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from portaserve.framework.interfaces import QuantMethod

INT8_MAX = 127


class NovaInt8Method(QuantMethod):
    """int8 weights, per-output-channel float32 scales, float activations (weight-only)."""

    name = "nova_int8"
    platforms = frozenset({"nova"})
    required_features = frozenset({"nova_int8"})
    #: The kit's error budget against the float layer: int8 rounding of each row's weights
    #: costs about 1% relative error on the output.
    conformance_tolerance = 2e-2

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype, bias: bool) -> None:
        # weight: [output_size, input_size] in the model dtype until it is loaded and quantized
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False) if bias else None
        layer.nova_act_dtype = params_dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data.float()  # [out, in]
        scale = w.abs().amax(dim=1) / INT8_MAX
        # a zero row gets scale 1 (any scale reproduces it) instead of a division by zero
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        layer.weight.data = q
        existing = getattr(layer, "weight_scale", None)
        if existing is not None:  # a second call, after a weight update
            existing.data = scale
            return
        param = nn.Parameter(scale, requires_grad=False)
        param.derived_after_loading = True
        param.output_dim = 0
        layer.weight_scale = param

    def checkpoint_layout(self, layer: nn.Module, param_name: str) -> torch.Tensor | None:
        if param_name != "weight" or layer.weight.dtype != torch.int8:
            return None
        return self._dequantized(layer).to(layer.nova_act_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        return F.linear(x, self._dequantized(layer).to(x.dtype), bias)

    @staticmethod
    def _dequantized(layer: nn.Module) -> torch.Tensor:
        """float32 [out, in]."""
        return layer.weight.float() * layer.weight_scale.float().unsqueeze(1)
