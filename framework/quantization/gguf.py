"""The "gguf" QuantMethod: a GGUF file's quantized weights kept quantized in memory.

The plan picks it for a decoder GGUF file (its config's `quantization_config` says
`quant_method: gguf`). The loader (`framework.gguf.weights`, quantized mode) hands each
2-D weight over as three checkpoint tensors in one layout whatever the GGML type:

    <name>.weight        uint8   [out, in]      integer codes
    <name>.weight_scale  float32 [out, in / 16]
    <name>.weight_min    float32 [out, in / 16]   (w = scale * code + min)

so fused projections (qkv, gate/up) and tensor-parallel shards cut them like float
weights. After loading each layer packs them (`gguf_layout`: 4-bit nibbles where the
codes fit, float16 scales, 32-wide groups where the type has them) and multiplies with
a kernel picked by the platform's declared features:

- the Triton kernel (`portaserve.kernels.gguf_matmul`) where the platform declares "triton";
- else the torch path: dequantize the packed weight for each call (correct everywhere,
  slow; a platform supplies a faster variant, as the CPU platform does with its C
  kernel: `variant_of = "gguf"`).

The embedding table is quantized too (`quantizes_embedding`), and a tied LM head
multiplies by the embedding's packed table: the model's resident weights are about the
file's size.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from portaserve.framework.interfaces import QuantMethod
from portaserve.framework.plugins import import_object

from .gguf_layout import GROUP, PackedGGUF, compose, dequantize_packed, pack, unpack

TRITON_GGUF_MATMUL = "portaserve.kernels.gguf_matmul:gguf_matmul"
_PARAMS = ("weight", "weight_scale", "weight_min")


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def packed_of(layer: nn.Module) -> PackedGGUF:
    """The layer's packed weight (its parameters after `process_weights_after_loading`)."""
    return PackedGGUF(layer.weight.data, layer.weight_scale.data, layer.weight_min.data, layer.gguf_bits, layer.gguf_group)


class GGUFMethod(QuantMethod):
    """GGUF quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) kept packed"""

    name = "gguf"
    # the kernels quantize activations to int8 per 16 values (0.3-0.5% relative error);
    # the weights are the file's own, so the kit's reference uses them exactly
    conformance_tolerance = 2e-2

    def __init__(self, config: dict | None = None) -> None:
        super().__init__(config)
        self._matmul = None

    # ----- loading ------------------------------------------------------------------

    def quantizes_embedding(self) -> bool:
        tensor_types = self.config.get("tensor_types")
        # without a file's config (the conformance kit): every table is quantized
        return tensor_types is None or f"{self.prefix}.weight" in tensor_types

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype, bias: bool) -> None:
        if input_size % 32:
            raise ValueError(f"{self.prefix}: GGUF weights hold whole blocks of 32 inputs; {input_size} inputs do not")
        layer.act_dtype = params_dtype
        layer.weight = _param(torch.empty(output_size, input_size, dtype=torch.uint8))
        for name in ("weight_scale", "weight_min"):
            setattr(layer, name, _param(torch.empty(output_size, input_size // GROUP, dtype=torch.float32)))
        for name in _PARAMS:
            param = getattr(layer, name)
            param.output_dim, param.input_dim = 0, 1
        layer.bias = _param(torch.empty(output_size, dtype=params_dtype)) if bias else None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed = pack(layer.weight.data, layer.weight_scale.data, layer.weight_min.data)
        tags = {n: dict(vars(getattr(layer, n))) for n in _PARAMS}
        for n in _PARAMS:
            delattr(layer, n)  # the unpacked codes go before the packed copy is kept
        layer.weight, layer.weight_scale, layer.weight_min = _param(packed.qweight), _param(packed.scales), _param(packed.mins)
        layer.gguf_bits, layer.gguf_group = packed.bits, packed.group
        for n, attrs in tags.items():
            vars(getattr(layer, n)).update(attrs)
        self._prepare(layer, packed)

    def _prepare(self, layer: nn.Module, packed: PackedGGUF) -> None:
        """Pick the matmul (a platform variant overrides this to use its own kernel)."""
        if "triton" in self.platform_features:
            self._matmul = import_object(TRITON_GGUF_MATMUL)

    def checkpoint_layout(self, layer: nn.Module, param_name: str) -> torch.Tensor | None:
        if not hasattr(layer, "gguf_bits") or param_name not in _PARAMS:
            return None
        return unpack(packed_of(layer))[_PARAMS.index(param_name)]

    def release_weights(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        saved = super().release_weights(layer)
        saved["_bits_group"] = torch.tensor([layer.gguf_bits, layer.gguf_group])
        return saved

    def restore_weights(self, layer: nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
        super().restore_weights(layer, {k: v for k, v in saved.items() if not k.startswith("_")})
        self._prepare(layer, packed_of(layer))

    # ----- compute --------------------------------------------------------------------

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not hasattr(layer, "gguf_bits"):
            raise RuntimeError(f"{self.prefix}: GGUF weights used before process_weights_after_loading")
        x2 = x.reshape(-1, x.shape[-1])
        if self._matmul is not None:
            y = self._matmul(x2, packed_of(layer), bias)
        else:
            y = F.linear(x2, dequantize_packed(packed_of(layer)).to(x.dtype), bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the packed table, dequantized: [len(ids), in] in the activation dtype."""
        packed = packed_of(layer)
        rows = PackedGGUF(packed.qweight[ids], packed.scales[ids], packed.mins[ids], packed.bits, packed.group)
        return dequantize_packed(rows).to(layer.act_dtype)

    # ----- conformance ----------------------------------------------------------------

    @classmethod
    def conformance_weights(cls, input_size: int, output_size: int, dtype: torch.dtype, generator: torch.Generator) -> dict[str, torch.Tensor]:
        # a Q4_1-like table: 4-bit codes, scale and min per 32 weights, both in float16
        codes = torch.randint(0, 16, (output_size, input_size), generator=generator, dtype=torch.uint8)
        groups = input_size // 32
        scale = ((0.5 + torch.rand(output_size, groups, generator=generator)) * 0.25 / input_size**0.5).half().float()
        low = (-7.5 * scale).half().float()
        scale, low = scale.repeat_interleave(2, dim=1), low.repeat_interleave(2, dim=1)
        bias = 0.5 * torch.randn(output_size, generator=generator)
        return {
            "weight": codes, "weight_scale": scale, "weight_min": low, "bias": bias.to(dtype),
            "reference_weight": compose(codes, scale, low),
        }
