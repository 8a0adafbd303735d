"""The "fp8" QuantMethod: e4m3 weights with per-channel scales, activations quantized per token.

`y = (qx @ qw^T) * sx * sw (+ b)`: the weight is quantized once (online from a float
checkpoint, or loaded pre-quantized from compressed-tensors FP8_DYNAMIC), each step's
activations are quantized row by row (`sx = max|x_row| / 448`), and the product runs on
the device's fp8 matrix units through `torch._scaled_mm` with row-wise scales. The
platform must declare "fp8_matmul" (CUDA capability >= 8.9, MI300-class ROCm GPUs);
a platform that also declares "fp8_e4m3fnuz" (MI300's gfx94x) gets weights in that
variant of e4m3, whose bias differs by one (values half as large, max 240).

The quantize/dequantize helpers and `fp8_scaled_mm_ref` (the float emulation of the
scaled matmul) run anywhere torch has float8 dtypes, the CPU included; the tests check
the math there.
"""

from __future__ import annotations

import torch
from torch import nn

from portaserve.framework.interfaces import QuantMethod

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_FNUZ = torch.float8_e4m3fnuz
#: Smallest activation scale: keeps an all-zero row finite.
MIN_SCALE = 1e-12


def fp8_max(dtype: torch.dtype = FP8_E4M3) -> float:
    return float(torch.finfo(dtype).max)


def quantize_fp8(x: torch.Tensor, dim: int, dtype: torch.dtype = FP8_E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric fp8 quantization with one scale per slice along `dim` reduced away.

    :param x: [rows, cols] float.
    :param dim: 1 for one scale per row (weights per output channel, activations per token).
    :returns: (q like x in `dtype`, scale float32 with `dim` kept as size 1) so that
        x ~= q.float() * scale.
    """
    xf = x.float()
    scale = (xf.abs().amax(dim=dim, keepdim=True) / fp8_max(dtype)).clamp_(min=MIN_SCALE)
    limit = fp8_max(dtype)
    q = (xf / scale).clamp_(-limit, limit).to(dtype)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q: fp8 [rows, cols], scale broadcastable to it -> float32."""
    return q.float() * scale.float()


def fp8_scaled_mm_ref(
    qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Float emulation of the fp8 scaled matmul (what `_scaled_mm` computes, in float32).

    :param qx: [M, K] fp8; sx: [M, 1] float32
    :param qw: [N, K] fp8; sw: [N, 1] float32
    :returns: [M, N] in `out_dtype`.
    """
    y = (qx.float() @ qw.float().t()) * sx.float() * sw.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_scaled_mm(
    qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`torch._scaled_mm` with row-wise scales; the emulation where its shape rules fail.

    Row-wise scaling wants bfloat16 output and K, N multiples of 16; other dtypes are
    cast from bf16 afterwards, other shapes fall back to `fp8_scaled_mm_ref`.
    """
    m, k = qx.shape
    n = qw.shape[0]
    if k % 16 or n % 16:
        return fp8_scaled_mm_ref(qx, sx, qw, sw, out_dtype, bias)
    # qw.t(): [K, N] column-major, the layout _scaled_mm wants for its second operand
    y = torch._scaled_mm(qx, qw.t(), scale_a=sx.float().contiguous(), scale_b=sw.float().reshape(1, n).contiguous(),
                         out_dtype=torch.bfloat16)
    y = y.to(out_dtype)
    return y if bias is None else y + bias.to(out_dtype)


def fnuz_from_e4m3fn(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-express e4m3fn values in e4m3fnuz: the same bits mean half the value there, so the
    scale doubles; the bit pattern 0x80 (-0 in fn, NaN in fnuz) becomes 0."""
    bits = q.view(torch.int8).clone()
    bits[bits == -128] = 0
    return bits.view(FP8_E4M3_FNUZ), scale * 2.0


class Fp8Method(QuantMethod):
    """fp8 weights and dynamically quantized activations for every linear layer."""

    name = "fp8"
    required_features = frozenset({"fp8_matmul"})
    # e4m3 weights (3 mantissa bits): ~3.1-3.4% relative error against the float matmul
    conformance_tolerance = 8e-2

    def __init__(self, config: dict | None = None, *, prequantized: bool = False) -> None:
        super().__init__(config)
        self.prequantized = prequantized
        self.prefix = ""

    def fp8_dtype(self) -> torch.dtype:
        return FP8_E4M3_FNUZ if "fp8_e4m3fnuz" in self.platform_features else FP8_E4M3

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype, bias: bool) -> None:
        layer.act_dtype = params_dtype
        if self.prequantized:
            # compressed-tensors FP8_DYNAMIC: weight [out, in] e4m3fn, weight_scale [out, 1]
            layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8_E4M3), requires_grad=False)
            scale = nn.Parameter(torch.empty(output_size, 1, dtype=torch.float32), requires_grad=False)
            scale.output_dim = 0
            layer.weight_scale = scale
        else:
            layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False) if bias else None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dtype = self.fp8_dtype()
        if self.prequantized:
            q, scale = layer.weight.data, layer.weight_scale.data.float().reshape(-1, 1)
            if dtype == FP8_E4M3_FNUZ:
                q, scale = fnuz_from_e4m3fn(q, scale)
        else:
            q, scale = quantize_fp8(layer.weight.data, dim=1, dtype=dtype)
        del layer.weight
        if hasattr(layer, "weight_scale"):
            del layer.weight_scale
        layer.weight = nn.Parameter(q.contiguous(), requires_grad=False)  # [out, in] fp8
        layer.weight_scale = nn.Parameter(scale.contiguous(), requires_grad=False)  # [out, 1] float32

    def checkpoint_layout(self, layer: nn.Module, param_name: str) -> torch.Tensor | None:
        if self.prequantized or param_name != "weight" or layer.weight.element_size() != 1:
            return None  # the checkpoint's own layout (or not processed yet)
        # online: the checkpoint holds float weights; a live update loads floats into this
        # tensor, and process_weights_after_loading quantizes them again
        return dequantize_fp8(layer.weight.data, layer.weight_scale.data).to(layer.act_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., in] -> x2: [num_tokens, in]; qx: fp8, sx: [num_tokens, 1]
        x2 = x.reshape(-1, x.shape[-1])
        qx, sx = quantize_fp8(x2, dim=1, dtype=layer.weight.dtype)
        y = fp8_scaled_mm(qx, sx, layer.weight, layer.weight_scale, x.dtype, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

