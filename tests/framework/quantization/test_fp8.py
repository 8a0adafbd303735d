"""fp8 (e4m3): the quantization math and the scaled matmul against float references on
the CPU (torch's float8 dtypes and `_scaled_mm` work there), the Fp8Method on a layer,
and the plan refusing fp8 on the CPU platform with what it supports instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quant_harness import make_plan

from portaserve.framework.errors import UnsupportedError
from portaserve.framework.quantization.fp8 import (
    FP8_E4M3,
    FP8_E4M3_FNUZ,
    Fp8Method,
    dequantize_fp8,
    fnuz_from_e4m3fn,
    fp8_max,
    fp8_scaled_mm,
    fp8_scaled_mm_ref,
    quantize_fp8,
)

#: e4m3 keeps 3 mantissa bits: rounding to nearest is within 2^-4 of the value (normal range)
E4M3_REL_STEP = 2.0**-4


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_quantize_per_row_roundtrip():
    torch.manual_seed(0)
    x = torch.randn(5, 64) * torch.tensor([1e-3, 0.1, 1.0, 50.0, 0.0])[:, None]
    q, scale = quantize_fp8(x, dim=1)
    assert q.dtype == FP8_E4M3 and scale.shape == (5, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale[:4, 0], x[:4].abs().amax(1) / 448.0)
    assert float(q.float().abs().amax(1)[:4].min()) == 448.0  # each row's max maps to fp8's max
    back = dequantize_fp8(q, scale)
    assert not q[4].float().any() and torch.isfinite(back).all()
    # elements above fp8's smallest normal (2^-6 in scaled units) are within half a step:
    # the step at magnitude v in [2^e, 2^(e+1)) is 2^(e-3)
    scaled = (x / scale)[:4]
    normal = scaled.abs() >= 2.0**-6
    err = ((back[:4] - x[:4]) / scale[:4]).abs()
    half_step = 2.0 ** (torch.floor(torch.log2(scaled.abs().clamp(min=2.0**-6))) - 4)
    assert bool((err[normal] <= half_step[normal] * 1.0001).all())
    assert float((err[normal] / scaled.abs()[normal]).max()) <= E4M3_REL_STEP


def test_quantize_saturates_and_per_column():
    x = torch.tensor([[1.0, -3.0], [2.0, 8.0]])
    q, scale = quantize_fp8(x, dim=0)  # one scale per column
    assert scale.shape == (1, 2)
    torch.testing.assert_close(dequantize_fp8(q, scale), x, rtol=E4M3_REL_STEP, atol=0)
    assert fp8_max(FP8_E4M3) == 448.0 and fp8_max(FP8_E4M3_FNUZ) == 240.0


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (9, 128, 48), (4, 40, 24)])  # the last: not a multiple of 16
def test_scaled_mm_vs_float_reference(out_dtype, m, k, n):
    torch.manual_seed(m + n)
    x, w, bias = torch.randn(m, k), torch.randn(n, k) * 0.05, torch.randn(n)
    qx, sx = quantize_fp8(x, dim=1)
    qw, sw = quantize_fp8(w, dim=1)
    # the emulation is exactly the dequantized product
    deq = dequantize_fp8(qx, sx).double() @ dequantize_fp8(qw, sw).double().t() + bias.double()
    ref = fp8_scaled_mm_ref(qx, sx, qw, sw, torch.float32, bias)
    assert rel(ref, deq) < 1e-6
    # _scaled_mm (bf16 output) agrees with the emulation up to bf16 rounding
    y = fp8_scaled_mm(qx, sx, qw, sw, out_dtype, bias)
    assert y.dtype == out_dtype and y.shape == (m, n)
    assert rel(y, deq) < 1e-2
    # and the whole scheme stays within fp8's rounding of the unquantized product
    assert rel(y, x.double() @ w.double().t() + bias.double()) < 0.08


def test_fnuz_conversion():
    torch.manual_seed(0)
    w = torch.randn(8, 32)
    q, scale = quantize_fp8(w, dim=1)
    q[0, 0] = torch.tensor(-0.0).to(FP8_E4M3)  # 0x80: NaN in fnuz
    qz, sz = fnuz_from_e4m3fn(q, scale)
    assert qz.dtype == FP8_E4M3_FNUZ and torch.isfinite(qz.float()).all()
    torch.testing.assert_close(dequantize_fp8(qz, sz), dequantize_fp8(q, scale), rtol=0, atol=0)


@pytest.mark.parametrize("fnuz", [False, True])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
def test_fp8_method_on_a_layer(fnuz, act_dtype):
    """create_weights -> load -> process -> apply, as a linear layer drives it."""
    torch.manual_seed(0)
    w, b, x = torch.randn(48, 64) * 0.05, torch.randn(48) * 0.1, torch.randn(3, 5, 64)
    method = Fp8Method()
    method.platform_features = frozenset({"fp8_matmul"} | ({"fp8_e4m3fnuz"} if fnuz else set()))
    layer = torch.nn.Module()
    method.create_weights(layer, 64, 48, act_dtype, bias=True)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == (FP8_E4M3_FNUZ if fnuz else FP8_E4M3) and layer.weight_scale.shape == (48, 1)
    y = method.apply(layer, x.to(act_dtype), layer.bias)
    assert y.shape == (3, 5, 48) and y.dtype == act_dtype
    assert rel(y, F.linear(x.double(), w.double(), b.double())) < 0.08
    if not fnuz:  # the product `_scaled_mm` computes, exactly (its bf16 output aside)
        qx, sx = quantize_fp8(x.to(act_dtype).reshape(-1, 64), dim=1)
        ref = fp8_scaled_mm_ref(qx, sx, layer.weight, layer.weight_scale, torch.float32, layer.bias)
        assert rel(y.reshape(-1, 48), ref) < 1e-2


def test_fp8_refused_on_cpu(checkpoint):
    folder = checkpoint("Qwen2ForCausalLM", dtype="float32")
    with pytest.raises(UnsupportedError) as err:
        make_plan(folder, quantization="fp8")
    msg = str(err.value)
    assert "quantization: 'fp8' is not available on platform cpu" in msg
    assert "fp8_matmul" in msg
    assert msg.endswith("methods supported there: compressed-tensors, gguf, int8, none")


def test_fp8_kv_cache_refused_on_cpu(checkpoint):
    folder = checkpoint("Qwen2ForCausalLM", dtype="float32")
    with pytest.raises(UnsupportedError, match=r"kv_cache_dtype: 'fp8' is not supported on platform cpu; supported: \['auto'\]"):
        make_plan(folder, kv_cache_dtype="fp8")


def test_unknown_method_lists_supported(checkpoint):
    folder = checkpoint("Qwen2ForCausalLM", dtype="float32")
    with pytest.raises(UnsupportedError, match=r"'gptq' is not available on platform cpu \(not registered\); methods supported there: compressed-tensors, gguf, int8, none"):
        make_plan(folder, quantization="gptq")


def test_fp8_gated_by_feature_not_platform():
    """Any platform declaring fp8_matmul gets it; the method never names a vendor."""
    assert Fp8Method.unsupported_reason(frozenset({"fp8_matmul"}), torch.bfloat16, {}) is None
    assert "fp8_matmul" in Fp8Method.unsupported_reason(frozenset({"int8_matmul", "triton"}), torch.bfloat16, {})
    assert Fp8Method.platforms is None


def test_online_fp8_gives_a_live_update_its_float_layout():
    """A weight update loads the checkpoint's float values into `checkpoint_layout`'s tensor
    and processes again: that tensor is the dequantized weight, and a second processing
    quantizes a new float weight like a fresh layer would."""
    from torch import nn

    method = Fp8Method()
    layer = nn.Module()
    method.create_weights(layer, 64, 32, torch.bfloat16, bias=False)
    assert method.checkpoint_layout(layer, "weight") is None  # not processed: the checkpoint's layout
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    layer.weight.data.copy_(w)
    method.process_weights_after_loading(layer)
    floats = method.checkpoint_layout(layer, "weight")
    assert floats.dtype == torch.bfloat16 and floats.shape == (32, 64)
    assert (floats.float() - w.float()).norm() / w.float().norm() < 0.05
    new = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    floats.copy_(new)
    layer.weight = nn.Parameter(floats, requires_grad=False)
    method.process_weights_after_loading(layer)
    fresh = nn.Module()
    method.create_weights(fresh, 64, 32, torch.bfloat16, bias=False)
    fresh.weight.data.copy_(new)
    Fp8Method().process_weights_after_loading(fresh)
    assert torch.equal(layer.weight.view(torch.uint8), fresh.weight.view(torch.uint8))
    assert torch.equal(layer.weight_scale, fresh.weight_scale)
