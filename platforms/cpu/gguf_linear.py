"""CpuGGUFMethod: the "gguf" method's matmul in C on the CPU (`gguf_matmul.c`).

It implements the framework's "gguf" QuantMethod (`variant_of`), with the same packed
layout and parameters; only the matmul differs: on AVX512-VNNI the activations are
quantized to int8 per block of 32 values and multiplied by the weight codes with
vpdpbusd, elsewhere a float loop reads the codes. Embedding rows are dequantized in C as
well. The plan picks it wherever the C kernels build (the platform declares "c_kernels").

By rows of x (M), measured on the 2-core AVX-512 machine over one SmolLM2 layer's four
matmuls (`benchmarks/gguf_kernels.py`, Q4_1, ms per layer):

| M | int8 dot products | bf16 small-batch GEMM (gguf_gemm.c) | expand + oneDNN GEMM |
|---|---|---|---|
| 1 | 0.10 | 0.23 | 0.47 |
| 8 | 0.38 | 0.32 | 0.57 |
| 32 | 1.50 | 0.82 | 0.96 |
| 128 | 6.49 | 3.12 | 3.68 |
| 512 | 26.1 | 11.8 | 10.4 |

so bf16 activations take the int8 dot products below `GEMM_ROWS` (6) rows, the
small-batch GEMM (4 weight rows expanded at a time in L1, AVX512-BF16) below
`DEQUANTIZE_ROWS` (192), and beyond that (prompts) the weight expanded once per call to
bf16 (ps_gguf_dequantize) and oneDNN's GEMM. float32 activations, or a CPU without
AVX512-BF16, switch from the dot products to oneDNN at `DEQUANTIZE_ROWS_F32` (12).
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
#: rows of bf16 x from which the small-batch GEMM (gguf_gemm.c) replaces the int8 dot products:
#: the two cost the same from 4 to 5 rows (BENCHMARKS.md), and speculative decoding's
#: verification of 4 proposals (5 rows of one sequence) then takes the dot products like
#: a decode, so its rows' numbers equal the decode's (token-identical outputs)
GEMM_ROWS = 6
#: rows of x from which a matmul dequantizes the weight and runs the platform's GEMM
DEQUANTIZE_ROWS = 192
#: the same without the small-batch GEMM (float32 x, or no AVX512-BF16)
DEQUANTIZE_ROWS_F32 = 12


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
        self._gemm = self._kernels is not None and bool(self._kernels.gguf_gemm_available())
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
        gemm = self._gemm and x.dtype == torch.bfloat16
        if m >= (DEQUANTIZE_ROWS if gemm else DEQUANTIZE_ROWS_F32) and x.dtype in (torch.bfloat16, torch.float32):
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
            fn = kernels.gguf_gemm if gemm and m >= GEMM_ROWS else kernels.gguf_matmul
            rc = fn(x2.data_ptr(), x2.stride(0), code, m, k, w, bits, group, scales, mins, n,
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
