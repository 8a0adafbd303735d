"""Pre-quantized compressed-tensors checkpoints: written here from a tiny float one, they
load and compute exactly what the online-quantized model computes; unsupported schemes
and formats fail at plan time with what is supported."""

from __future__ import annotations

import json

import pytest
import torch
from ct_checkpoint import quantization_config, write_compressed
from quant_harness import linear_layers, load_model, make_plan, prompt_logits

from portaserve.framework.errors import UnsupportedError
from portaserve.framework.quantization.compressed_tensors import CompressedTensorsMethod, parse_config

PROMPT = list(range(700, 730))


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    from portaserve.models.checkpoints import write_checkpoint

    return write_checkpoint("Qwen2ForCausalLM", "tiny", tmp_path_factory.mktemp("float"), 0, dtype="float32", tokenizer=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_w8a16_matches_online_int8(float_checkpoint, tmp_path, dtype, scale_dtype):
    folder = write_compressed(float_checkpoint, tmp_path / "w8a16", "W8A16", scale_dtype=scale_dtype, quantize_from=getattr(torch, dtype))
    pre = load_model(str(folder), dtype=dtype)
    online = load_model(str(float_checkpoint), dtype=dtype, quantization="int8")
    assert pre.plan.quantization.name == "compressed-tensors"
    assert "quantization_config (compressed-tensors)" in pre.plan.quantization.reason
    for (name, a), (_, b) in zip(linear_layers(pre.model), linear_layers(online.model)):
        assert a.quant_method.delegate.name == "int8", name
        assert torch.equal(a.weight, b.weight), name  # the same int8 values, fused q/k/v and gate/up included
        # the CPU kernel keeps its scales in bf16: a bf16-stored scale rounds to the same value
        assert torch.equal(a.weight_scale, b.weight_scale), name
    assert torch.equal(prompt_logits(pre, PROMPT), prompt_logits(online, PROMPT))


def test_ignored_layers_stay_float(float_checkpoint, tmp_path):
    folder = write_compressed(float_checkpoint, tmp_path / "partial", "W8A16", skip=("layers.0.mlp.",))
    pre = load_model(str(folder), dtype="float32")
    kinds = {name: m.quant_method.delegate.name for name, m in linear_layers(pre.model)}
    assert kinds["model.layers.0.mlp.gate_up_proj"] == "none" and kinds["model.layers.0.mlp.down_proj"] == "none"
    assert kinds["model.layers.0.self_attn.qkv_proj"] == "int8" and kinds["model.layers.1.mlp.down_proj"] == "int8"
    logits = prompt_logits(pre, PROMPT)
    ref = prompt_logits(load_model(str(float_checkpoint), dtype="float32"), PROMPT)
    assert float((logits - ref).norm() / ref.norm()) < 0.04


def test_fused_parts_must_agree(float_checkpoint, tmp_path):
    folder = write_compressed(float_checkpoint, tmp_path / "split", "W8A16", skip=("layers.0.self_attn.q_proj",))
    with pytest.raises(UnsupportedError, match="qkv_proj.*different schemes"):
        load_model(str(folder), dtype="float32")


def test_fp8_dynamic_refused_on_cpu(float_checkpoint, tmp_path):
    folder = write_compressed(float_checkpoint, tmp_path / "fp8", "FP8_DYNAMIC")
    with pytest.raises(UnsupportedError) as err:
        make_plan(str(folder), dtype="float32")
    msg = str(err.value)
    assert "'compressed-tensors' is not available on platform cpu" in msg
    assert "group 'group_0' runs as 'fp8', which needs platform features ['fp8_matmul']" in msg
    assert msg.endswith("methods supported there: compressed-tensors, gguf, int8, none")


def test_fp8_dynamic_matches_online_fp8(float_checkpoint, tmp_path, monkeypatch):
    """On a platform declaring fp8_matmul (here the CPU, told so: torch's _scaled_mm runs
    there), the FP8_DYNAMIC checkpoint computes what online fp8 computes."""
    import dataclasses

    from portaserve.platforms.cpu.platform import CpuPlatform

    real = CpuPlatform.capabilities
    monkeypatch.setattr(CpuPlatform, "capabilities",
                        lambda self: dataclasses.replace(real(self), features=real(self).features | {"fp8_matmul"}))
    folder = write_compressed(float_checkpoint, tmp_path / "fp8", "FP8_DYNAMIC", quantize_from=torch.bfloat16)
    pre = load_model(str(folder), dtype="bfloat16")
    online = load_model(str(float_checkpoint), dtype="bfloat16", quantization="fp8")
    for (name, a), (_, b) in zip(linear_layers(pre.model), linear_layers(online.model)):
        assert a.weight.dtype == torch.float8_e4m3fn and torch.equal(a.weight.view(torch.int8), b.weight.view(torch.int8)), name
        torch.testing.assert_close(a.weight_scale, b.weight_scale, rtol=0, atol=0)
    got, want = prompt_logits(pre, PROMPT), prompt_logits(online, PROMPT)
    assert torch.equal(got, want)
    ref = prompt_logits(load_model(str(float_checkpoint), dtype="bfloat16"), PROMPT)
    assert float((got - ref).norm() / ref.norm()) < 0.15


def test_requantizing_a_quantized_checkpoint_is_refused(float_checkpoint, tmp_path):
    folder = write_compressed(float_checkpoint, tmp_path / "w8a16", "W8A16")
    with pytest.raises(UnsupportedError, match="already quantized.*leave --quantization unset or pass compressed-tensors"):
        make_plan(str(folder), quantization="int8")


@pytest.mark.parametrize(
    "change,expected",
    [
        ({"format": "pack-quantized"}, "format 'pack-quantized' packs weights into int32"),
        ({"weights": {"num_bits": 4}}, "4-bit weights"),
        ({"weights": {"symmetric": False}}, "asymmetric"),
        ({"weights": {"strategy": "tensor"}}, "strategy 'tensor'"),
        ({"weights": {"strategy": "group", "group_size": 128}}, "strategy 'group'"),
        ({"input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}, "W8A8"),
        ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    ],
)
def test_unsupported_schemes(change, expected):
    cfg = quantization_config("W8A16")
    group = cfg["config_groups"]["group_0"]
    for key, value in change.items():
        if key in ("weights",):
            group["weights"].update(value)
        elif key == "input_activations":
            group["input_activations"] = value
        else:
            cfg[key] = value
    with pytest.raises(UnsupportedError) as err:
        parse_config(cfg)
    assert expected in str(err.value)
    assert "supported: W8A16" in str(err.value) and "FP8_DYNAMIC" in str(err.value)
    reason = CompressedTensorsMethod.unsupported_reason(frozenset({"int8_matmul"}), torch.float32, cfg)
    assert reason is not None and expected in reason


def test_target_precedence():
    cfg = quantization_config("W8A16")
    fp8_group = json.loads(json.dumps(cfg["config_groups"]["group_0"]))
    fp8_group.update(
        weights={**fp8_group["weights"], "type": "float"},
        input_activations={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        targets=["re:.*down_proj$"],
    )
    cfg["config_groups"]["group_1"] = fp8_group
    cfg["ignore"] = ["lm_head", "re:.*layers\\.3\\..*"]
    m = CompressedTensorsMethod(cfg)
    assert m.method_for("model.layers.0.mlp.down_proj") == "fp8"  # named target beats "Linear"
    assert m.method_for("model.layers.0.mlp.gate_up_proj") == "int8"
    assert m.method_for("model.layers.0.self_attn.qkv_proj") == "int8"
    assert m.method_for("model.layers.3.self_attn.o_proj") == "none"
