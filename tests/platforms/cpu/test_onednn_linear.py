"""The CPU platform's oneDNN-prepacked variant of the unquantized linear method.

Checked against `F.linear` on the same weights — bit-identical in bf16 (there `F.linear`
runs the same oneDNN kernel, plus a per-call weight reorder), within fp32 rounding in
fp32 (there `F.linear` runs MKL's sgemm, which sums in another order) — and for what
the plan says about it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from portaserve.platforms.cpu.onednn_linear import OneDnnLinearMethod, onednn_supports

DTYPES = [d for d in (torch.float32, torch.bfloat16) if onednn_supports(d)]


def _layer(out_f: int, in_f: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    layer = nn.Module()
    method = OneDnnLinearMethod()
    method.create_weights(layer, in_f, out_f, dtype, bias)
    g = torch.Generator().manual_seed(seed)
    layer.weight.data.copy_(torch.randn(out_f, in_f, generator=g).to(dtype))
    if bias:
        layer.bias.data.copy_(torch.randn(out_f, generator=g).to(dtype))
    dense = layer.weight.data.clone()
    method.process_weights_after_loading(layer)
    return layer, method, dense


@pytest.mark.skipif(not DTYPES, reason="this CPU's oneDNN runs neither fp32 nor bf16 matmuls")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1,), (7,), (33,), (2, 5)])
def test_matches_f_linear(dtype, bias, shape):
    exact = {"rtol": 0, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    layer, method, dense = _layer(96, 64, dtype, bias)
    x = torch.randn(*shape, 64).to(dtype)
    want = F.linear(x, dense, layer.bias)
    got = method.apply(layer, x, layer.bias)
    assert got.shape == want.shape == (*shape, 96)
    torch.testing.assert_close(got, want, **exact)
    # a non-contiguous input (a slice of a fused projection) too
    wide = torch.randn(*shape, 128).to(dtype)
    torch.testing.assert_close(method.apply(layer, wide[..., ::2], None), F.linear(wide[..., ::2], dense), **exact)


@pytest.mark.skipif(not DTYPES, reason="this CPU's oneDNN runs neither fp32 nor bf16 matmuls")
def test_dense_storage_is_freed_and_values_stay_readable():
    layer, method, dense = _layer(48, 32, DTYPES[-1], bias=True)
    weight = layer.weight
    assert weight.shape == dense.shape and weight.dtype == dense.dtype
    assert weight.untyped_storage().nbytes() == dense.element_size()  # a placeholder, not a copy
    assert torch.equal(method.checkpoint_layout(layer, "weight"), dense)
    assert torch.equal(layer.state_dict()["weight"], dense)
    # what a live update does: new dense values in, then repack
    new = torch.randn_like(dense, dtype=torch.float32).to(dense.dtype)
    weight.data = new.clone()
    method.process_weights_after_loading(layer)
    x = torch.randn(3, 32).to(dense.dtype)
    torch.testing.assert_close(method.apply(layer, x, layer.bias), F.linear(x, new, layer.bias), rtol=0, atol=0)
    method.process_weights_after_loading(layer)  # a second run with nothing new is harmless
    assert torch.equal(layer.state_dict()["weight"], new)


@pytest.mark.skipif(not DTYPES, reason="this CPU's oneDNN runs neither fp32 nor bf16 matmuls")
def test_release_and_restore_weights():
    """Sleep level 2 through the QuantMethod interface: the packed copy goes, the real
    values (not the placeholder's) reach the host, and restoring repacks them."""
    layer, method, dense = _layer(48, 32, DTYPES[-1], bias=True)
    bias = layer.bias.data.clone()
    x = torch.randn(3, 32).to(dense.dtype)
    want = method.apply(layer, x, layer.bias)
    saved = method.release_weights(layer)
    assert layer.packed_weight is None
    assert all(p.numel() == 0 for p in layer.parameters())
    assert torch.equal(saved["weight"], dense) and torch.equal(saved["bias"], bias)
    method.restore_weights(layer, saved)
    assert layer.weight.shape == dense.shape and layer.packed_weight is not None
    assert layer.weight.untyped_storage().nbytes() == dense.element_size()  # repacked: the placeholder again
    torch.testing.assert_close(method.apply(layer, x, layer.bias), want, rtol=0, atol=0)


def test_plan_uses_it_for_none_on_cpu_unless_compiling(plugin_env):
    from portaserve.framework.config import EngineConfig
    from portaserve.framework.plan import resolve_plan
    from portaserve.framework.plugins import get_registry
    from portaserve.framework.selection import choose_platform

    hf = {
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
        "vocab_size": 1000, "max_position_embeddings": 512, "torch_dtype": "bfloat16",
    }
    registry = get_registry()
    platform = choose_platform(registry, "cpu")
    for dtype in ("float32", "bfloat16"):
        plan = resolve_plan(EngineConfig(dtype=dtype), registry, platform, hf)
        if onednn_supports(plan.torch_dtype):
            assert plan.quantization.name == "onednn"
            assert "implements 'none'" in plan.quantization.reason
        else:
            assert plan.quantization.name == "none"
            assert dict(plan.quantization.rejected)["onednn"].startswith("this CPU's oneDNN has no")
    compiled = resolve_plan(EngineConfig(dtype="float32", compilation_mode="max"), registry, platform, hf)
    assert compiled.quantization.name == "none"
    assert "torch.compile" in dict(compiled.quantization.rejected)["onednn"]
    # an explicitly named method is not replaced: --quantization none is plain F.linear
    plain = resolve_plan(EngineConfig(dtype="float32", quantization="none"), registry, platform, hf)
    assert plain.quantization.name == plain.unquantized_method == "none"
    int8 = resolve_plan(EngineConfig(dtype="bfloat16", quantization="int8"), registry, platform, hf)
    assert int8.quantization.name == "int8"
