"""The conformance kit checks the ops and quant methods a plugin contributes.

Issue 22, failure 3: nothing in the kit checked ops or quant methods. Here the op
implementations and the quant method of tests/framework/testing/vllm_layout_plugin.py pass the kit's
checks (:mod:`portaserve.framework.testing.op_checks`, :mod:`.quant_checks`), and planted
bugs in copies of them are caught. The whole kit runs on the installed plugin in
tests/framework/testing/test_conformance.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from vllm_layout_plugin import GELU_AND_MUL, TransposedLinearMethod, gelu_and_mul, rms_norm

from portaserve.framework.op_references import BUILTIN_OP_SPECS
from portaserve.framework.testing.op_checks import compare_op
from portaserve.framework.testing.quant_checks import check_quant_method

CPU = torch.device("cpu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
RMS_NORM = next(spec for spec in BUILTIN_OP_SPECS if spec.name == "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_plugins_ops_match_their_references(dtype):
    assert compare_op(gelu_and_mul, GELU_AND_MUL, CPU, dtype) == []
    assert compare_op(rms_norm, RMS_NORM, CPU, dtype) == []


def test_a_wrong_op_is_caught():
    def swapped_halves(x):
        gate, up = x.chunk(2, dim=-1)
        return gelu_and_mul(torch.cat((up, gate), dim=-1))

    problems = compare_op(swapped_halves, GELU_AND_MUL, CPU, torch.bfloat16)
    assert problems and all("relative error" in p for p in problems)


def test_an_op_that_writes_its_input_undeclared_is_caught():
    def in_place(x, weight, eps):
        out = rms_norm(x, weight, eps)
        x.copy_(out)  # the spec does not declare mutates_inputs
        return out

    problems = compare_op(in_place, RMS_NORM, CPU, torch.float32)
    assert problems and "mutates_inputs" in problems[0]


def test_a_wrong_output_structure_is_caught():
    problems = compare_op(lambda x: (gelu_and_mul(x), x), GELU_AND_MUL, CPU, torch.float32)
    assert problems and "outputs" in problems[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_plugins_quant_method_matches_the_float_linear(dtype):
    assert check_quant_method(TransposedLinearMethod, CPU, dtype) is None


class DropsBias(TransposedLinearMethod):
    def apply(self, layer, x, bias=None):
        return super().apply(layer, x, None)


class RoundsWeightToBf16(TransposedLinearMethod):
    def process_weights_after_loading(self, layer):
        super().process_weights_after_loading(layer)
        layer.weight_t = layer.weight_t.to(torch.bfloat16).to(layer.weight_t.dtype)


@pytest.mark.parametrize("buggy", [DropsBias, RoundsWeightToBf16])
def test_a_wrong_quant_method_is_caught(buggy):
    with pytest.raises(AssertionError, match="relative error"):
        check_quant_method(buggy, CPU, torch.float32)


def _int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.float().abs().amax(dim=1, keepdim=True) / 127  # [out, 1]
    return torch.round(weight.float() / scale).to(torch.int8), scale


class OnlineInt8(TransposedLinearMethod):
    """Quantizes the loaded float weight to int8 per output channel."""

    def process_weights_after_loading(self, layer):
        q, scale = _int8(layer.weight.data)
        layer.weight_t = (q.float() * scale).to(layer.weight.dtype).t().contiguous()


class OnlineInt8WithBudget(OnlineInt8):
    conformance_tolerance = 3e-2


def test_a_quantizing_method_states_its_error_budget():
    with pytest.raises(AssertionError, match="conformance_tolerance"):
        check_quant_method(OnlineInt8, CPU, torch.float32)
    assert check_quant_method(OnlineInt8WithBudget, CPU, torch.float32) is None


class PrequantizedInt8(TransposedLinearMethod):
    """A checkpoint format holding int8 weights and per-channel scales."""

    conformance_tolerance = 1e-2

    def create_weights(self, layer, input_size, output_size, params_dtype, bias):
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=torch.int8), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(output_size, 1), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False) if bias else None
        layer.act_dtype = params_dtype

    def process_weights_after_loading(self, layer):
        dense = layer.weight.data.float() * layer.weight_scale.data
        layer.weight_t = dense.to(layer.act_dtype).t().contiguous()


class PrequantizedInt8WithWeights(PrequantizedInt8):
    @classmethod
    def conformance_weights(cls, input_size, output_size, dtype, generator):
        tensors = super().conformance_weights(input_size, output_size, dtype, generator)
        q, scale = _int8(tensors["weight"])
        tensors.update(weight=q, weight_scale=scale, reference_weight=(q.float() * scale))
        return tensors


def test_a_prequantized_format_is_skipped_unless_it_provides_conformance_weights():
    reason = check_quant_method(PrequantizedInt8, CPU, torch.float32)
    assert reason and "conformance_weights" in reason and "'weight'" in reason
    assert check_quant_method(PrequantizedInt8WithWeights, CPU, torch.float32) is None
