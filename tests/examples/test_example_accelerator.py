"""The pip-installed example accelerator plugin (examples/portaserve-example-accelerator,
platform "nova") exercises the whole plugin contract, and works with its own defaults:

- it passes the conformance kit (a separate pytest process, as a vendor runs it);
- ``LLM(model, device="nova")`` with no other option generates token-identical to
  transformers: block size 32 from the platform, its vLLM-style KV layout, its own Llama
  implementation calling the op it declares (``split_qkv_rope``), and the plan says so;
- its quantization method ``nova_int8`` stays close to the unquantized model;
- tensor parallelism over its own communicator gives the single-rank tokens;
- a live weight update and sleep level 2 work through its own model's loaders and its
  int8 method's checkpoint layout.

Install it first: ``pip install ./examples/portaserve-example-accelerator`` (.ci/run
does, and sets PORTASERVE_REQUIRE_EXAMPLES=1 so that a missing install fails instead of
skipping)."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from importlib import metadata

import pytest
import torch

DIST = "portaserve-example-accelerator"
ARCH = "LlamaForCausalLM"


def _installed() -> bool:
    try:
        metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        return False
    return True


if not _installed() and os.environ.get("PORTASERVE_REQUIRE_EXAMPLES") == "1":
    raise RuntimeError(f"PORTASERVE_REQUIRE_EXAMPLES=1 but {DIST} is not installed")
pytestmark = [
    pytest.mark.usefixtures("plugin_env"),
    pytest.mark.skipif(not _installed(), reason=f"pip install ./examples/{DIST} first"),
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    """A tiny random-weight Llama checkpoint (float32, untied, head_dim 32) with a tokenizer."""
    from portaserve.models.checkpoints import write_checkpoint

    folder = tmp_path_factory.mktemp("nova-llama")
    write_checkpoint(ARCH, "tiny", folder, 0)
    return str(folder)


def _plan(folder: str, **options):
    from portaserve.framework.checkpoint import load_hf_config
    from portaserve.framework.config import EngineConfig
    from portaserve.framework.plan import resolve_plan
    from portaserve.framework.plugins import get_registry
    from portaserve.framework.selection import choose_platform

    registry = get_registry()
    config = EngineConfig.create(model=folder, device="nova", **options)
    return resolve_plan(config, registry, choose_platform(registry, "nova"), load_hf_config(folder))


def assert_nova_plan(plan) -> None:
    """What the plan must say about nova's own defaults and components, and why."""
    rows = dict(plan.choices())
    assert plan.platform.name == "nova"
    assert plan.block_size == 32
    assert rows["block_size"].name == "32" and "platform nova's default" in rows["block_size"].reason
    model = rows["model"]
    assert model.name == ARCH and "platform nova's own implementation from plugin nova" in model.reason
    assert [name for name, _ in model.rejected] == [f"{ARCH} (models)"]
    attention = rows["attention[full]"]
    assert attention.name == "nova_paged" and "preferred" in attention.reason
    assert rows["kv_cache_allocator"].name == "nova" and rows["communicator"].name == "nova_gloo"
    ops = dict(plan.custom_ops)
    assert ops["split_qkv_rope"] == "nova" and ops["silu_and_mul"] == "nova"
    assert ops["rms_norm"] == "reference"  # not implemented by nova: the torch reference runs
    text = str(plan)
    assert "split_qkv_rope=nova" in text and "block_size          32  (platform nova's default" in text


# ----- fast: the plan, the components in process -------------------------------------------


def test_plan_takes_novas_defaults_and_components(llama):
    plan = _plan(llama)
    assert_nova_plan(plan)
    assert plan.dtype == "float32" and plan.quantization.name == "none"
    from portaserve.framework.plugins import get_registry

    registry = get_registry()
    model_cls = registry.architecture(ARCH, "nova")
    assert model_cls.__module__ == "portaserve_example_accelerator.llama"
    # every other platform keeps the generic implementation
    assert registry.architecture(ARCH, "cpu").__module__ == "portaserve.models.llama"


def test_novas_model_declines_what_it_cannot_run_and_the_generic_one_serves(llama):
    from portaserve.framework.checkpoint import load_hf_config
    from portaserve.framework.config import EngineConfig
    from portaserve.framework.plan import resolve_plan
    from portaserve.framework.plugins import get_registry
    from portaserve.framework.selection import choose_platform

    registry = get_registry()
    hf_config = {**load_hf_config(llama), "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    plan = resolve_plan(EngineConfig.create(model=llama, device="nova"), registry, choose_platform(registry, "nova"), hf_config)
    assert not plan.platform_model and plan.model_class(registry).__module__ == "portaserve.models.llama"
    (name, why), = plan.model_architecture.rejected
    assert name == f"{ARCH} (nova, platform nova's own)" and "not 'dynamic'" in why


def test_block_size_the_platform_cannot_serve_fails_before_loading(llama):
    from portaserve.framework.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match=r"block_size: 16 is not supported on platform nova; supported: \[32\]"):
        _plan(llama, block_size=16)


def test_auto_keeps_choosing_cpu():
    from portaserve.framework.plugins import get_registry
    from portaserve.framework.selection import choose_platform

    registry = get_registry()
    choice = choose_platform(registry, "auto", strict=False)
    assert choice.platform_cls.name == "cpu"
    assert choose_platform(registry, "nova", strict=False).instantiate().torch_device(1) == torch.device("cpu")


def test_vllm_layout_attention_case():
    """One kit scenario in process (prefills, decodes, a chunk on a cached prefix) on the
    [2, num_blocks, ...] layout; the slow kit run below covers the whole grid."""
    from portaserve.framework.plugins import get_registry
    from portaserve.framework.testing.attention_checks import AttentionCase, mixed_steps, run_case

    backend_cls = get_registry().get("attention_backends", "nova_paged")
    assert backend_cls.kv_cache_block_dim == 1
    case = AttentionCase("mixed-nova", 8, 2, 64, 32, torch.float32, mixed_steps(32))
    result = run_case(backend_cls, case, "cpu")
    assert result.skipped is None and len(result.errors) == len(case.steps)


def test_nova_int8_quantizes_and_gives_the_float_weight_back():
    from torch import nn

    from portaserve.framework.plugins import get_registry

    cls = get_registry().get("quant_methods", "nova_int8")
    method = cls()
    layer = nn.Module()
    method.create_weights(layer, 96, 40, torch.float32, bias=True)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=gen) / 10
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(40, generator=gen))
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.derived_after_loading
    x = torch.randn(5, 96, generator=gen)
    ref = torch.nn.functional.linear(x, w, layer.bias)
    err = float((method.apply(layer, x, layer.bias) - ref).norm() / ref.norm())
    assert 0 < err < 1e-2
    # a live weight update loads into the checkpoint layout and processes again
    restored = method.checkpoint_layout(layer, "weight")
    assert restored.dtype == torch.float32 and float((restored - w).abs().max()) <= float(w.abs().max()) / 127
    layer.weight.data = restored
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.int8


# ----- slow: the kit, the engine end to end ---------------------------------------------


def run_kit(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PORTASERVE_")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "portaserve.framework.testing", "-q", "-rs",
           "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_passes_the_conformance_kit(tmp_path):
    proc = run_kit(tmp_path, "--platform", "nova")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    tail = proc.stdout.strip().splitlines()[-1]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail)}
    assert counts.get("passed", 0) >= 50 and not counts.get("failed") and not counts.get("error"), out[-3000:]
    assert "portaserve conformance kit: platform nova" in proc.stdout
    # the vLLM-style layout and nova's op implementations were really checked, not skipped
    skips = re.findall(r"SKIPPED \[\d+\] (\S+): (.*)", proc.stdout)
    for module in ("test_ops.py", "test_communicator.py", "test_kv_cache.py", "test_capabilities.py"):
        assert not [s for s in skips if module in s[0]], out[-3000:]
    # nova_paged skips only the encoder cases it declares unsupported (a portable backend such
    # as triton, declared for any platform with its feature, is skipped for the feature)
    nova_skips = [s for s in skips if "test_attention_backends.py" in s[0] and "needs platform features" not in s[1]]
    assert not [s for s in nova_skips if "encoder" not in s[1]], out[-3000:]


def _prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 150000) for _ in range(n)] for n in lengths]


def _hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation (its end-of-sequence token switched off below)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _greedy(max_tokens: int, **kw):
    from portaserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def nova_llm(llama):
    from portaserve import LLM

    engine = LLM(llama, device="nova")  # nothing else: nova's defaults
    yield engine
    engine.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_generates_token_identical_to_transformers_with_its_own_defaults(nova_llm, llama):
    transformers = pytest.importorskip("transformers")
    assert_nova_plan(nova_llm.plan)
    # prompts shorter and longer than a block of 32, one batch
    prompts = _prompts([5, 17, 33, 70, 9, 48], seed=1)
    first = nova_llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(24, prompt_logprobs=0), use_tqdm=False)
    ours = _token_ids(first)
    # then prompts that share 64 tokens (two full blocks) with one already served: the
    # prefix cache hands them its blocks, so only the rest is prefilled
    shared = prompts[3][:64]
    followups = [shared + tail for tail in _prompts([3, 40], seed=2)]
    hits = nova_llm.llm_engine.stats().prefix_cache_hits
    ours += _token_ids(nova_llm.generate([{"prompt_token_ids": p} for p in followups], _greedy(24), use_tqdm=False))
    assert nova_llm.llm_engine.stats().prefix_cache_hits - hits >= 2 * 64
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # 24 tokens, whatever they are
    for prompt, tokens in zip(prompts + followups, ours):
        assert tokens == _hf_greedy(ref, prompt, 24), f"prompt of {len(prompt)} tokens diverged from transformers"
    # closer than tokens: the logprob of every prompt token (a random tiny model's attention
    # is nearly uniform, so an attention or rotary bug can leave the argmax unchanged)
    for prompt, out in zip(prompts, first):
        ours_lp = torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
        with torch.no_grad():
            logprobs = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), dim=-1)
        ref_lp = logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        err = (ours_lp - ref_lp).abs().max().item()
        assert err < 1e-4, f"prompt of {len(prompt)} tokens: prompt logprobs differ from transformers' by {err:.3g}"
    assert sum(len(set(t)) for t in ours) / len(ours) >= 4  # not a degenerate repeat


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nova_int8_stays_close_to_the_float_model(nova_llm, llama):
    from portaserve import LLM

    prompts = _prompts([17, 33, 40], seed=3)
    params = _greedy(1, prompt_logprobs=0)

    def prompt_logprobs(engine) -> list[float]:
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        # the logprob each position gives the prompt's actual next token
        return [next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]]

    float_lp = prompt_logprobs(nova_llm)
    engine = LLM(llama, device="nova", quantization="nova_int8")
    try:
        quant = dict(engine.plan.choices())["quantization"]
        assert quant.name == "nova_int8" and quant.reason == "--quantization nova_int8"
        int8_lp = prompt_logprobs(engine)
    finally:
        engine.shutdown()
    diffs = [abs(a - b) for a, b in zip(float_lp, int8_lp, strict=True)]
    # quantized (not identical), and well within the logprobs' own spread
    spread = torch.tensor(float_lp).std().item()
    assert 0 < sum(diffs) / len(diffs) < 0.1 * spread and max(diffs) < 0.5 * spread, (max(diffs), spread)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_over_novas_communicator_gives_the_same_tokens(nova_llm, llama):
    from portaserve import LLM

    prompts = _prompts([5, 33, 70], seed=4)
    want = _token_ids(nova_llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(16), use_tqdm=False))
    engine = LLM(llama, device="nova", tensor_parallel_size=2)
    try:
        assert engine.plan.communicator.name == "nova_gloo"
        got = _token_ids(engine.generate([{"prompt_token_ids": p} for p in prompts], _greedy(16), use_tqdm=False))
    finally:
        engine.shutdown()
    assert got == want


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_live_weight_update_and_sleep_through_novas_model_and_int8(llama, tmp_path_factory):
    """The loader conventions, kept by a plugin's own model and quant method: a weight
    update stages through each parameter's weight_loader into nova_int8's checkpoint
    layout and quantizes again; sleep level 2 releases and restores the weights."""
    from portaserve import LLM
    from portaserve.models.checkpoints import write_checkpoint

    other = tmp_path_factory.mktemp("nova-llama-seed1")
    write_checkpoint(ARCH, "tiny", other, 1)
    prompts = _prompts([5, 33, 70], seed=5)

    def run(engine) -> list[list[int]]:
        return _token_ids(engine.generate([{"prompt_token_ids": p} for p in prompts], _greedy(12), use_tqdm=False))

    fresh = LLM(str(other), device="nova", quantization="nova_int8")
    try:
        want = run(fresh)
    finally:
        fresh.shutdown()
    engine = LLM(llama, device="nova", quantization="nova_int8")
    try:
        before = run(engine)
        engine.update_weights(str(other))
        assert run(engine) == want != before
        engine.sleep(level=2)
        engine.wake_up()
        assert run(engine) == want
    finally:
        engine.shutdown()
