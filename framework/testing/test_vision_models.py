"""Conformance: vision-language models on the platform compute what they compute on the
host's torch reference (contract 1.4).

A vision tower attends through the platform's attention backend in encoder mode (the
"vision" layer type: non-causal, a sequence per image or per window), and the decoder
reads image embeddings in place of placeholder tokens and, for Qwen2-VL, 3-D rotary
positions. For each registered vision-language architecture with a checkpoint writer,
a tiny random-weight checkpoint serves a prompt holding two images of different sizes
on the platform and on the host platform (`device="cpu"`); the prompt's logprobs must
agree and, in float32, the greedy tokens too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from portaserve.framework.interfaces import ModelArchitecture

LOGPROB_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.15, torch.float16: 0.05}
NEW_TOKENS = 8


def _vision_architectures(registry) -> list[str]:
    writers = set(registry.names("checkpoint_writers"))
    out = []
    for name in sorted(set(registry.names("model_architectures")) & writers):
        cls = registry.architecture(name, None, generic=True)
        if cls.multimodal_processor.__func__ is not ModelArchitecture.multimodal_processor.__func__:
            out.append(name)
    return out


def _images():
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8)) for size in ((120, 160, 3), (70, 90, 3))]


def _run(folder: str, device: str, dtype: torch.dtype):
    from portaserve import LLM, SamplingParams

    llm = LLM(folder, device=device, dtype=str(dtype).removeprefix("torch."), kv_cache_memory=0.25)
    try:
        placeholder = llm.llm_engine.processor.mm_processor.placeholder_token_id
        prompt = [3, 5, placeholder, 7, 11, 13, placeholder, 17, 19]
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
        out = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": _images()}}, params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    logprobs = torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
    return list(out.outputs[0].token_ids), logprobs


@pytest.mark.timeout(600)
def test_vision_language_models_match_the_host_reference(registry, platform, tmp_path):
    archs = _vision_architectures(registry)
    if not archs:
        pytest.skip("no vision-language architecture with a checkpoint writer is registered")
    from portaserve.framework.errors import UnsupportedError

    caps = platform.capabilities()
    dtype = torch.float32 if torch.float32 in caps.dtypes else next(iter(caps.preferred_dtypes))
    unsupported = []
    for arch in archs:
        folder = tmp_path / arch
        registry.get("checkpoint_writers", arch)(str(folder), "tiny", 0)
        try:
            tokens, logprobs = _run(str(folder), platform.name, dtype)
        except UnsupportedError as exc:  # the platform declares it cannot serve these shapes
            unsupported.append(f"{arch}: {exc}")
            continue
        ref_tokens, ref_logprobs = _run(str(folder), "cpu", dtype)
        err = (logprobs - ref_logprobs).abs().max().item()
        tol = LOGPROB_TOLERANCE.get(dtype, 0.1)
        assert err <= tol, f"{platform.name}: {arch}'s prompt logprobs differ from the host's by {err:.3g} > {tol:g}"
        if dtype == torch.float32:
            assert tokens == ref_tokens, f"{platform.name}: {arch}'s greedy tokens differ from the host's"
    if unsupported:
        pytest.skip("; ".join(unsupported))
