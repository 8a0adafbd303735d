"""Int8 weight-only matmul kernels, picked once per layer by the platform's declared features.

Each kernel computes `y = (x @ q^T) * s (+ b)` for x: [num_tokens, in] in the model's
dtype, q: [out, in] int8 and s: [out]; `prepare` stores q and s on the layer in the form
its matmul wants (so `layer.parameters()` measures the real weight memory).

- "cpu_int8pack": torch's `_weight_int8pack_mm` (int8 weights, per-channel scales,
  vectorized for AVX2/AVX-512). Measured on the 2-core AVX2 dev machine (BENCHMARKS.md,
  Qwen2-0.5B linear shapes, M = 1..64 tokens): with bfloat16 activations it beats both
  bf16 and fp32 `F.linear` at decode sizes, while its fp32 and fp16 activation paths are
  5-20x slower. So every model dtype runs it with bfloat16 activations (an fp32 model's
  activations are rounded to bf16 for the matmul; the int8 rounding of the weights
  dominates that error). Its bf16 path segfaults in torch 2.13 unless in_features is
  a multiple of the vector width: 8 was enough on AVX2, but on an AVX-512 machine
  (Zen5) in_features 72 and 136 crash while 64, 80 and 144 work — hence the
  `in_features % 16` check (other layers take the dequantize path). Runs where the
  platform declares "int8_weight_pack_mm" (the CPU).
- "triton_int8": `portaserve.kernels.int8_matmul` where the platform declares "triton"
  (imported lazily: the framework never imports triton itself).
- "torch_dequant": `F.linear(x, q.to(dtype)) * s`, everywhere else (XLA fuses the cast).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from portaserve.framework.plugins import import_object

TRITON_INT8_MATMUL = "portaserve.kernels.int8_matmul:int8_weight_only_mm"


class Int8Kernel(ABC):
    """One way to multiply by an int8 weight with per-output-channel scales."""

    name: ClassVar[str]
    #: Platform features the kernel needs (PlatformCapabilities.features).
    required_features: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def can_run(cls, features: frozenset[str], act_dtype: torch.dtype, in_features: int) -> bool:
        """Whether this kernel serves a layer with these activations on a platform declaring `features`."""
        return cls.required_features <= features

    @abstractmethod
    def prepare(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Store q ([out, in] int8) and scale ([out] float32) on `layer` as parameters."""

    @abstractmethod
    def matmul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: [num_tokens, in] -> [num_tokens, out] in x's dtype."""


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class CpuInt8PackKernel(Int8Kernel):
    name = "cpu_int8pack"
    required_features = frozenset({"int8_weight_pack_mm"})
    #: the one activation dtype torch's CPU kernel is fast for (see the module docstring)
    compute_dtype = torch.bfloat16

    @classmethod
    def can_run(cls, features, act_dtype, in_features) -> bool:
        return super().can_run(features, act_dtype, in_features) and in_features % 16 == 0

    def prepare(self, layer, q, scale) -> None:
        layer.weight = _param(q.contiguous())
        layer.weight_scale = _param(scale.to(self.compute_dtype))

    def matmul(self, layer, x, bias):
        y = torch.ops.aten._weight_int8pack_mm(x.to(self.compute_dtype), layer.weight, layer.weight_scale)
        y = y.to(x.dtype)
        return y if bias is None else y + bias


class TritonInt8Kernel(Int8Kernel):
    name = "triton_int8"
    required_features = frozenset({"triton"})

    def prepare(self, layer, q, scale) -> None:
        layer.weight = _param(q.contiguous())
        layer.weight_scale = _param(scale.float())
        self._mm = import_object(TRITON_INT8_MATMUL)

    def matmul(self, layer, x, bias):
        return self._mm(x, layer.weight, layer.weight_scale, bias)


class TorchDequantKernel(Int8Kernel):
    name = "torch_dequant"

    def prepare(self, layer, q, scale) -> None:
        layer.weight = _param(q.contiguous())
        layer.weight_scale = _param(scale.float())

    def matmul(self, layer, x, bias):
        # the scale commutes with the sum over in_features: apply it to the [tokens, out] result
        y = F.linear(x, layer.weight.to(x.dtype)) * layer.weight_scale.to(x.dtype)
        return y if bias is None else y + bias


#: Tried in order; the first that can run serves the layer.
INT8_KERNELS: tuple[type[Int8Kernel], ...] = (CpuInt8PackKernel, TritonInt8Kernel, TorchDequantKernel)


def choose_int8_kernel(features: frozenset[str], act_dtype: torch.dtype, in_features: int) -> Int8Kernel:
    """The first kernel of `INT8_KERNELS` that serves this layer on a platform declaring
    `features` (the torch one always can)."""
    for cls in INT8_KERNELS:
        if cls.can_run(features, act_dtype, in_features):
            return cls()
    raise AssertionError("TorchDequantKernel always runs")  # unreachable
