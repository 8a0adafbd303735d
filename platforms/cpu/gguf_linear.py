"""CpuGGUFMethod: the "gguf" method's matmul in C on the CPU (`gguf_matmul.c`).

It implements the framework's "gguf" QuantMethod (`variant_of`), with the same packed
layout and parameters; only the matmul differs: on AVX512-VNNI the activations are
quantized to int8 per block of 32 values and multiplied by the weight codes with
vpdpbusd, elsewhere a float loop reads the codes. Embedding rows are dequantized in C as
well. The plan picks it wherever the C kernels build (the platform declares "c_kernels").

From `DEQUANTIZE_ROWS` (12) rows of x on (a prefill, a batch of 12+ decodes) the layer's
weight is expanded to the activation dtype once per call (ps_gguf_dequantize, a few MB
at a time) and multiplied by oneDNN's GEMM. Measured on the 2-core AVX-512 machine over
one SmolLM2 layer's four matmuls (`benchmarks/gguf_kernels.py`): the int8 dot products
cost ~50 us per row of x; expanding the weight ~0.2 ms and the GEMM ~0.25 ms plus ~15 us
per row (about equal at 12 rows, 1.6x faster at 32); a decode's few rows stay with the
dot products, which read 4-5 bits a weight, not 16.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from portaserve.framework.quantization.gguf import GGUFMethod, packed_of
from portaserve.framework.quantization.gguf_layout import PackedGGUF

from . import native

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: rows of x from which a matmul dequantizes the weight and runs the platform's GEMM
DEQUANTIZE_ROWS = 12


def gguf_matmul(kernels: native.NativeKernels, x: torch.Tensor, packed: PackedGGUF, bias: torch.Tensor | None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [M, K] (float32 / bfloat16 / float16, rows contiguous) -> [M, N] in `out_dtype` (x's)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    n, k = packed.shape
    m = x.shape[0]
    out_dtype = out_dtype or x.dtype
    y = torch.empty(m, n, dtype=out_dtype)
    if m == 0:
        return y
    b = None if bias is None else bias.float().contiguous()
    rc = kernels.gguf_matmul(
        x.data_ptr(), x.stride(0), _DTYPES[x.dtype], m, k, packed.qweight.data_ptr(), packed.bits, packed.group,
        packed.scales.data_ptr(), packed.mins.data_ptr(), n, None if b is None else b.data_ptr(), y.data_ptr(),
        n, _DTYPES[out_dtype], torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"ps_gguf_matmul failed ({rc}) for x {tuple(x.shape)} and a {n} x {k} weight")
    return y


class CpuGGUFMethod(GGUFMethod):
    """the matmul in C: int8 activations times the weight codes (AVX512-VNNI)"""

    name = "gguf_cpu"
    platforms = frozenset({"cpu"})
    variant_of = "gguf"
    variant_priority = 10
    traceable = False

    @classmethod
    def unsupported_reason(cls, features: frozenset[str], act_dtype: torch.dtype, config: Mapping[str, Any]) -> str | None:
        if "c_kernels" not in features:
            return "the CPU's C kernels are not available (no C compiler, or PORTASERVE_CPU_NATIVE=0)"
        return super().unsupported_reason(features, act_dtype, config)

    def _prepare(self, layer: nn.Module, packed: PackedGGUF) -> None:
        self._kernels = native.load()  # None: the framework's torch path (logged by native)
        # A decode step calls ~120 of these for one token: everything that does not change
        # per call (pointers, sizes, the float32 bias) is computed once here.
        n, k = packed.shape
        self._fixed = (k, packed.qweight.data_ptr(), packed.bits, packed.group, packed.scales.data_ptr(),
                       packed.mins.data_ptr(), n)
        self._bias = None if layer.bias is None else layer.bias.data.float().contiguous()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        kernels = getattr(self, "_kernels", None)
        if kernels is None or x.device.type != "cpu" or x.dtype not in _DTYPES:
            return super().apply(layer, x, bias)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        k, w, bits, group, scales, mins, n = self._fixed
        if m >= DEQUANTIZE_ROWS and x.dtype in (torch.bfloat16, torch.float32):
            weight = torch.empty(n, k, dtype=x.dtype)
            rc = kernels.gguf_dequantize(w, bits, group, scales, mins, n, k, weight.data_ptr(), _DTYPES[x.dtype],
                                         torch.get_num_threads())
            if rc != 0:
                raise RuntimeError(f"{self.prefix}: ps_gguf_dequantize failed ({rc})")
            y = torch.nn.functional.linear(x2, weight, bias)
            return y.reshape(*x.shape[:-1], n)
        y = torch.empty(m, n, dtype=x.dtype)
        if m:
            if bias is None:
                b = None
            elif bias is layer.bias and self._bias is not None:
                b = self._bias
            else:
                b = bias.float().contiguous()
            code = _DTYPES[x.dtype]
            rc = kernels.gguf_matmul(x2.data_ptr(), x2.stride(0), code, m, k, w, bits, group, scales, mins, n,
                                     None if b is None else b.data_ptr(), y.data_ptr(), n, code, torch.get_num_threads())
            if rc != 0:
                raise RuntimeError(f"{self.prefix}: ps_gguf_matmul failed ({rc}) for x {tuple(x2.shape)}")
        return y.reshape(*x.shape[:-1], n)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        kernels = getattr(self, "_kernels", None)
        if kernels is None or layer.act_dtype not in _DTYPES:
            return super().embedding(layer, ids)
        packed = packed_of(layer)
        rows, cols = packed.shape
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], cols, dtype=layer.act_dtype)
        rc = kernels.gguf_embedding(ids.data_ptr(), ids.shape[0], packed.qweight.data_ptr(), packed.bits, packed.group,
                                    packed.scales.data_ptr(), packed.mins.data_ptr(), rows, cols, out.data_ptr(),
                                    _DTYPES[layer.act_dtype])
        if rc != 0:
            raise ValueError(f"embedding ids out of range [0, {rows})")
        return out
