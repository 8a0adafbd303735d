"""Tensor parallelism through the multiprocess executor: TP=2 (two spawned worker
processes, gloo) gives exactly the greedy tokens of TP=1 for every causal architecture,
and each rank holds only its shard of the model."""

from __future__ import annotations

import math

import pytest

from portaserve import LLM
from portaserve.framework.executor.weight_update import read_checkpoint_specs

from .util import CAUSAL_ARCHS, ENGINE_KW, generate_ids, prompts_of

# Multi-process runs: the full suite only.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# Mixed lengths: single-block, multi-block and chunked (> max_num_batched_tokens) prompts.
PROMPTS = prompts_of([3, 17, 40, 90], seed=7)

# What each tiny checkpoint exercises under TP=2 (see models/checkpoints.py):
CASES = {
    "LlamaForCausalLM": "untied embeddings, head_dim 32 != hidden/heads, 2 KV heads split 1 per rank",
    "Qwen2ForCausalLM": "tied embeddings, qkv bias, a sliding-window layer",
    "Qwen3ForCausalLM": "1 KV head < 2 ranks (replicated), q/k norm, tied embeddings",
    "MistralForCausalLM": "untied embeddings, sliding window 8",
}


def _rank_info(llm):
    return llm.llm_engine.core.executor.call_workers("weights_info")


@pytest.mark.parametrize("arch", CAUSAL_ARCHS)
def test_tp2_matches_tp1(arch, checkpoint, reference_ids):
    assert arch in CASES
    folder = checkpoint(arch)
    expected = reference_ids(PROMPTS, 10, arch)
    llm = LLM(folder, tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE_KW)
    try:
        assert generate_ids(llm, PROMPTS, 10) == expected
        ranks = _rank_info(llm)
    finally:
        llm.shutdown()
    assert [r["rank"] for r in ranks] == [0, 1]
    assert len({r["pid"] for r in ranks}) == 2, "each rank runs in its own process"
    # Every matrix is split (norms and replicated KV heads are a few KiB): no rank holds
    # the model, each holds about half of it.
    full = sum(math.prod(s.shape) * 4 for s in read_checkpoint_specs(folder).values())  # float32
    for r in ranks:
        assert abs(r["num_bytes"] - full / 2) < 0.03 * full, (r, full)


def test_tp2_untied_qwen2(checkpoint, reference_ids):
    """Qwen2 with its own LM head (the tiny checkpoint ties it)."""
    options = {"config_overrides": {"tie_word_embeddings": False}}
    folder = checkpoint("Qwen2ForCausalLM", 0, **options)
    expected = reference_ids(PROMPTS, 6, "Qwen2ForCausalLM", 0, **options)
    llm = LLM(folder, tensor_parallel_size=2, **ENGINE_KW)  # backend auto: mp for TP > 1
    try:
        assert generate_ids(llm, PROMPTS, 6) == expected
    finally:
        llm.shutdown()


def test_tp4_replicates_kv_heads(checkpoint, reference_ids):
    """Llama tiny has 2 KV heads: under TP=4 each KV head lives on 2 ranks."""
    folder = checkpoint("LlamaForCausalLM")
    expected = reference_ids(PROMPTS[:2], 6, "LlamaForCausalLM")
    llm = LLM(folder, tensor_parallel_size=4, **ENGINE_KW)
    try:
        assert generate_ids(llm, PROMPTS[:2], 6) == expected
    finally:
        llm.shutdown()


def test_uni_backend_rejects_tp2(checkpoint):
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(checkpoint("Qwen2ForCausalLM"), tensor_parallel_size=2, distributed_executor_backend="uni", **ENGINE_KW)


def test_ray_backend_without_ray_names_the_extra(monkeypatch):
    import sys

    from portaserve.framework.errors import UnsupportedError
    from portaserve.framework.executor.ray_executor import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(UnsupportedError, match=r"pip install 'portaserve\[ray\]'"):
        import_ray()


def test_tp2_gguf_matches_tp1(tmp_path):
    """A GGUF model (Q8_0 matrices, llama's permuted Q/K) split over two ranks."""
    from model_files.gguf_files import write_decoder

    gguf = write_decoder(tmp_path / "tiny.gguf", arch="llama", matrix_type="Q8_0", layers=2, heads=4, kv_heads=2)
    prompts = prompts_of([3, 17, 40], seed=9, vocab=250)
    single = LLM(str(gguf), **ENGINE_KW)
    try:
        expected = generate_ids(single, prompts, 10)
    finally:
        single.shutdown()
    llm = LLM(str(gguf), tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE_KW)
    try:
        assert generate_ids(llm, prompts, 10) == expected
    finally:
        llm.shutdown()


VISION_WRITERS = {
    "LlavaForConditionalGeneration": ("write_llava", {}),
    "Qwen2VLForConditionalGeneration": ("write_qwen_vl", {"variant": "qwen2_vl"}),
    "Qwen2_5_VLForConditionalGeneration": ("write_qwen_vl", {"variant": "qwen2_5_vl"}),
}


@pytest.mark.parametrize("arch", sorted(VISION_WRITERS))
def test_tp2_vision_language_models_match_tp1(arch, tmp_path):
    """The vision tower's heads, MLP and projector / merger split across the ranks like the
    decoder's; every rank encodes the step's images."""
    import numpy as np
    from PIL import Image

    from portaserve import SamplingParams
    from portaserve.models import checkpoints_vl

    writer, options = VISION_WRITERS[arch]
    folder = str(getattr(checkpoints_vl, writer)(tmp_path / "ckpt", "tiny", 4, **options))
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((70, 90), (120, 160))]
    pad = checkpoints_vl.IMAGE_PAD_ID
    prompts = [{"prompt_token_ids": [5, pad, 9, 11, pad, 13], "multi_modal_data": {"image": images}},
               {"prompt_token_ids": [7, 8, 9, 10, 11]}]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def run(tp: int):
        llm = LLM(folder, tensor_parallel_size=tp, **ENGINE_KW)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()

    assert run(2) == run(1)


def test_tp2_structured_outputs_match_tp1(checkpoint):
    """The step's grammar bitmask crosses to the worker processes (as bytes) and every rank
    masks the same logits: TP=2 gives TP=1's constrained greedy output."""
    from portaserve import SamplingParams
    from portaserve.framework.structured.params import StructuredOutputsParams

    folder = checkpoint("Qwen2ForCausalLM")
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "y"]}}}
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True))
    kw = {**ENGINE_KW, "skip_tokenizer_init": False}

    def run(tp: int):
        llm = LLM(folder, tensor_parallel_size=tp, **kw)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, params,
                                                                       use_tqdm=False)]
        finally:
            llm.shutdown()

    single = run(1)
    assert run(2) == single


def test_tp2_speculative_decoding_matches_tp1(checkpoint, tmp_path):
    """Under TP=2 both ranks verify the same proposals: a draft model (each rank runs its
    shard of the draft; rank 0's proposals are broadcast) and n-gram proposals under a
    grammar (the per-position mask rows cross to the workers) give TP=1's tokens."""
    from portaserve import SamplingParams
    from portaserve.framework.structured.params import StructuredOutputsParams
    from portaserve.models.truncated import truncate_checkpoint

    folder = checkpoint("Qwen2ForCausalLM")
    draft = truncate_checkpoint(folder, tmp_path / "draft", 2)
    phrase = [101, 2020, 303, 4040]
    prompts = [{"prompt_token_ids": phrase * 3}, *prompts_of([5, 21], seed=3)]
    regex = StructuredOutputsParams(regex="(yes|no)(, (yes|no)){3,20}\\.")
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0, structured_outputs=regex),
              SamplingParams(max_tokens=24, temperature=0.5, seed=4, ignore_eos=True)]
    kw = {**ENGINE_KW, "skip_tokenizer_init": False}
    configs = ({"model": str(draft), "num_speculative_tokens": 3}, {"method": "ngram", "prompt_lookup_min": 1})

    def run(tp: int, spec_config=None):
        llm = LLM(folder, tensor_parallel_size=tp, speculative_config=spec_config, **kw)
        try:
            out = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
            return out, llm.llm_engine.stats().spec_num_accepted_tokens
        finally:
            llm.shutdown()

    plain, _ = run(1)
    for spec_config in configs:
        got, accepted = run(2, spec_config)
        assert got == plain and accepted > 0, spec_config
