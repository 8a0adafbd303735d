"""On simulated CUDA / ROCm / XPU machines, `portaserve platforms` shows the Triton
attention backend and the Triton fused ops in the plan, with the reasons; TPU gets the
XLA backend; the CPU never picks Triton unless forced under the interpreter."""

from __future__ import annotations

import json

import pytest

from portaserve.framework.cli import main


def platforms_json(capsys) -> dict:
    from portaserve.framework.plugins import reset_registry

    reset_registry()
    main(["platforms", "--json"])
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("vendor", ["cuda", "rocm", "xpu"])
def test_gpu_platforms_plan_triton(vendor, fake_devices, plugin_env, capsys):
    getattr(fake_devices, vendor)()
    doc = platforms_json(capsys)
    sel = doc["selection"]
    assert sel["selected"] == vendor, sel
    by_name = {c["name"]: c for c in sel["plan"]["attention_candidates"]}
    assert "preferred" in by_name["triton"]["reason"], by_name["triton"]
    assert "cpu_paged" in by_name and "triton" not in by_name["cpu_paged"]["reason"]
    record = next(p for p in doc["plugins"] if p["name"] == vendor)
    assert "rms_norm:triton" in record["contributes"]["custom_ops"]


def test_resolved_plan_on_simulated_cuda_binds_triton(fake_devices, plugin_env, engine_tiny_config):
    from portaserve.framework.config import EngineConfig
    from portaserve.framework.plan import resolve_plan
    from portaserve.framework.plugins import get_registry
    from portaserve.framework.selection import choose_platform

    fake_devices.cuda()
    registry = get_registry()
    plan = resolve_plan(EngineConfig(dtype="bfloat16"), registry, choose_platform(registry, "auto"), engine_tiny_config)
    assert plan.platform.name == "cuda"
    assert {choice.name for _, choice in plan.attention} == {"triton"}
    bound = {op: impl for op, impl in plan.custom_ops if impl != "reference"}  # installed plugins may declare more ops
    assert bound == {op: "triton" for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding",
                                            "apply_token_bitmask", "lora_linear")}
    assert "triton" in str(plan)


def test_cpu_never_prefers_triton(plugin_env, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    doc = platforms_json(capsys)
    by_name = {c["name"]: c for c in doc["selection"]["plan"]["attention_candidates"]}
    assert "preferred" in by_name["cpu_paged"]["reason"]
    assert "preferred" not in by_name["triton"]["reason"]
