"""Conformance: every model implementation the platform brings for itself (hook
``portaserve_platform_model_architectures``) computes what the generic implementation of
the same architecture computes.

For each such architecture with a registered checkpoint writer, a tiny random-weight
checkpoint is served twice: by the platform's model on the platform (the engine as a user
runs it, with the platform's defaults), and by the generic model on the host platform
(``device="cpu"``, portaserve's torch reference). Greedy tokens must match, and so must
the log-probability of every prompt token (a random tiny model's attention is nearly
uniform, so a rotary or attention bug can leave the argmax unchanged but not these).
"""

from __future__ import annotations

import random

import pytest
import torch

from portaserve.framework.testing.platform_under_test import resolve

#: Max absolute difference of prompt-token logprobs accepted per activation dtype.
LOGPROB_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.15, torch.float16: 0.05}
PROMPT_LENGTHS = (5, 17, 40)
NEW_TOKENS = 8


def _params(put) -> list:
    caps = put.capabilities()
    if caps is None:
        return [pytest.param(None, id="platform-unavailable")]
    archs = sorted(arch for platform, arch in put.registry.platform_models if platform == put.name)
    return [pytest.param(arch, id=arch) for arch in archs] or [pytest.param(None, id="no-platform-model")]


def pytest_generate_tests(metafunc):
    if "platform_arch" in metafunc.fixturenames:
        metafunc.parametrize("platform_arch", _params(resolve(metafunc.config)))


def _dtype(caps) -> torch.dtype:
    if torch.float32 in caps.dtypes:
        return torch.float32
    return next(iter(caps.preferred_dtypes), None) or sorted(caps.dtypes, key=str)[0]


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def _run(folder: str, device: str, dtype: torch.dtype, prompts):
    from portaserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    llm = LLM(folder, device=device, dtype=str(dtype).removeprefix("torch."), kv_cache_memory=0.25)
    try:
        plan = llm.plan
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]) for o in outputs]
    return plan, tokens, logprobs


@pytest.mark.timeout(600)
def test_platform_model_matches_the_generic_one(platform_arch, registry, platform, tmp_path):
    if platform_arch is None:
        pytest.skip(f"platform {platform.name} brings no model implementation of its own")
    if platform_arch not in registry.names("checkpoint_writers"):
        pytest.skip(f"no checkpoint writer is registered for {platform_arch}: nothing to build a test checkpoint with")
    if platform_arch not in registry.names("model_architectures"):
        pytest.skip(f"{platform_arch} has no generic implementation to compare with")
    registry.get("checkpoint_writers", platform_arch)(str(tmp_path), "tiny", 0)
    from portaserve.framework.checkpoint import load_hf_config

    prompts = _prompts(int(load_hf_config(tmp_path)["vocab_size"]))
    dtype = _dtype(platform.capabilities())
    plan, tokens, logprobs = _run(str(tmp_path), platform.name, dtype, prompts)
    assert plan.platform_model, f"the plan did not use {platform.name}'s own {platform_arch}: {plan.model_architecture}"
    _ref_plan, ref_tokens, ref_logprobs = _run(str(tmp_path), "cpu", dtype, prompts)
    tol = LOGPROB_TOLERANCE.get(dtype, 0.1)
    for n, (ours, ref) in enumerate(zip(logprobs, ref_logprobs, strict=True)):
        err = (ours - ref).abs().max().item()
        assert err <= tol, (
            f"{platform.name}'s {platform_arch}: prompt {n} ({len(prompts[n])} tokens) logprobs differ from the "
            f"generic model's by {err:.3g} > {tol:g}"
        )
    if dtype == torch.float32:  # low precision may flip a near-tie; float32 must not
        assert tokens == ref_tokens, f"{platform.name}'s {platform_arch}: greedy tokens differ from the generic model's"
