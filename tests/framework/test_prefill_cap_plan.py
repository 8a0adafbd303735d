"""The ExecutionPlan's prefill cap: 'auto' takes the platform's measured serving default,
an integer is the user's, 0 and None mean no cap, and without chunked prefill there is
nothing to cap. `portaserve serve` asks for 'auto'; the offline API for no cap."""

from __future__ import annotations

import pytest

from portaserve.framework.config import EngineConfig
from portaserve.framework.errors import InvalidParameterError



def plan_for(hf_config, device="cpu", **kw):
    from portaserve.framework.plan import resolve_plan
    from portaserve.framework.plugins import get_registry
    from portaserve.framework.selection import choose_platform

    registry = get_registry()
    return resolve_plan(EngineConfig.create(device=device, **kw), registry, choose_platform(registry, device), hf_config)


@pytest.mark.parametrize("asked,want", [("auto", 96), (None, None), (0, None), (7, 7)])
def test_cpu_plan_prefill_cap(plugin_env, engine_tiny_config, asked, want):
    plan = plan_for(engine_tiny_config, max_prefill_tokens_with_decodes=asked)
    assert plan.prefill_cap_with_decodes == want
    row = dict(plan.choices())["prefill_cap"]
    assert row.name == (f"{want} prompt tokens" if want else "none")
    if asked == "auto":
        assert "platform cpu's measured serving default" in row.reason
    assert "prefill_cap" in str(plan)


def test_no_cap_without_chunked_prefill(plugin_env, engine_tiny_config):
    plan = plan_for(engine_tiny_config, max_prefill_tokens_with_decodes="auto", enable_chunked_prefill=False)
    assert plan.prefill_cap_with_decodes is None
    assert "chunked prefill is off" in plan.prefill_cap.reason


def test_gpu_platform_default_is_no_cap(fake_devices, plugin_env, engine_tiny_config):
    fake_devices.cuda()
    plan = plan_for(engine_tiny_config, device="auto", max_prefill_tokens_with_decodes="auto")
    assert plan.platform.name == "cuda" and plan.prefill_cap_with_decodes is None


@pytest.mark.parametrize("bad", [-1, "x", 1.5, True])
def test_bad_cap_names_the_parameter_and_the_allowed_values(bad):
    with pytest.raises(InvalidParameterError, match="max_prefill_tokens_with_decodes") as info:
        EngineConfig.create(max_prefill_tokens_with_decodes=bad)
    assert "'auto'" in str(info.value) and ">= 0" in str(info.value)


def test_serve_asks_for_auto_and_the_flag_overrides():
    from portaserve.framework.cli import build_parser
    from portaserve.framework.cli.serve import engine_kwargs

    parse = build_parser().parse_args
    assert EngineConfig.create(**engine_kwargs(parse(["serve"]))).max_prefill_tokens_with_decodes == "auto"
    assert EngineConfig.create(**engine_kwargs(parse(["serve", "--max-prefill-tokens-with-decodes", "0"]))).max_prefill_tokens_with_decodes == 0
    assert EngineConfig.create(**engine_kwargs(parse(["serve", "--max-prefill-tokens-with-decodes", "64"]))).max_prefill_tokens_with_decodes == 64
    assert EngineConfig().max_prefill_tokens_with_decodes is None  # LLM(...): no cap


def test_serve_flag_rejects_words_other_than_auto(capsys):
    from portaserve.framework.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--max-prefill-tokens-with-decodes", "many"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--max-prefill-tokens-with-decodes" in err and "'auto'" in err and "'many'" in err


def test_no_cap_for_an_encoder(plugin_env, engine_tiny_config):
    bert = {**engine_tiny_config, "architectures": ["BertModel"], "type_vocab_size": 2, "torch_dtype": "float32"}
    plan = plan_for(bert, max_prefill_tokens_with_decodes="auto")
    assert plan.prefill_cap_with_decodes is None
    assert "never split" in plan.prefill_cap.reason
