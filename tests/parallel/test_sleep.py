"""Sleep / wake for RL loops: level 1 releases the KV cache, level 2 also moves the weights
to host memory (their device storage is freed); wake_up restores both and the engine
generates exactly what it did before. Requests while asleep are rejected."""

from __future__ import annotations

import pytest
import torch

from portaserve import LLM
from portaserve.framework.errors import InvalidParameterError

from .util import ENGINE_KW, generate_ids, prompts_of

ARCH = "Qwen2ForCausalLM"
PROMPTS = prompts_of([7, 33], seed=5)


def _kv_bytes(llm) -> int:
    return sum(r["kv_cache_bytes"] for r in llm.llm_engine.core.executor.call_workers("weights_info"))


def test_sleep_levels_release_and_restore_memory(checkpoint, reference_ids):
    llm = LLM(checkpoint(ARCH), **ENGINE_KW)
    try:
        want = reference_ids(PROMPTS, 8, ARCH, 0)
        assert generate_ids(llm, PROMPTS) == want
        kv = _kv_bytes(llm)
        model = llm.llm_engine.core.executor.worker.runner.model
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

        released = llm.sleep(level=1)
        assert released == {"level": 1, "kv_cache_bytes": kv, "weights_bytes": 0}
        assert llm.is_sleeping() and _kv_bytes(llm) == 0
        with pytest.raises(InvalidParameterError, match="sleeping"):
            llm.generate(PROMPTS, use_tqdm=False)
        assert llm.wake_up() == {"sleep_level": 0, "kv_cache_bytes": kv, "weights_bytes": 0}
        assert not llm.is_sleeping()
        assert generate_ids(llm, PROMPTS) == want

        released = llm.sleep(level=2)
        assert released["kv_cache_bytes"] == kv and released["weights_bytes"] == weight_bytes
        # the device tensors' storage is gone (on the CPU too), the parameters remain
        assert all(p.numel() == 0 for p in model.parameters())
        with pytest.raises(InvalidParameterError, match="wake_up first"):
            llm.update_weights(checkpoint(ARCH, 1))
        restored = llm.wake_up(tags=["weights"])
        assert restored["weights_bytes"] == weight_bytes and restored["sleep_level"] == 1
        assert llm.is_sleeping()  # the KV cache is still released
        # RL loop order: weights back, new weights in, then the KV cache
        llm.update_weights(checkpoint(ARCH, 1))
        assert llm.wake_up(tags=["kv_cache"])["kv_cache_bytes"] == kv
        assert generate_ids(llm, PROMPTS) == reference_ids(PROMPTS, 8, ARCH, 1)
        with pytest.raises(InvalidParameterError, match="level"):
            llm.sleep(level=3)
        with pytest.raises(InvalidParameterError, match="tags"):
            llm.wake_up(tags=["gpu"])
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_sleep_and_wake_under_tp2(checkpoint, reference_ids):
    llm = LLM(checkpoint(ARCH), tensor_parallel_size=2, **ENGINE_KW)
    try:
        want = reference_ids(PROMPTS, 8, ARCH, 0)
        kv = _kv_bytes(llm)
        released = llm.sleep(level=2)
        assert released["kv_cache_bytes"] == kv > 0 and released["weights_bytes"] > 0
        restored = llm.wake_up()
        assert restored["kv_cache_bytes"] == kv and restored["weights_bytes"] == released["weights_bytes"]
        assert generate_ids(llm, PROMPTS) == want
    finally:
        llm.shutdown()


def test_sleep_level2_on_an_int8_engine_restores_the_same_outputs(checkpoint):
    """int8 keeps its own packed weights and scales (no oneDNN placeholder): level 2
    moves them to host memory as they are and wake_up puts them back unrequantized."""
    llm = LLM(checkpoint(ARCH), quantization="int8", **ENGINE_KW)
    try:
        want = generate_ids(llm, PROMPTS)
        model = llm.llm_engine.core.executor.worker.runner.model
        qkv = model.model.layers[0].self_attn.qkv_proj
        int8_params = {name: p.detach().clone() for name, p in qkv.named_parameters()}
        assert any(p.dtype == torch.int8 for p in int8_params.values())
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        released = llm.sleep(level=2)
        assert released["weights_bytes"] == weight_bytes > 0
        assert all(p.numel() == 0 for p in model.parameters())
        restored = llm.wake_up()
        assert restored["weights_bytes"] == released["weights_bytes"]
        for name, p in qkv.named_parameters():
            assert p.dtype == int8_params[name].dtype and torch.equal(p, int8_params[name]), name
        assert generate_ids(llm, PROMPTS) == want
    finally:
        llm.shutdown()


def test_sleep_level2_moves_the_draft_model_too(checkpoint, reference_ids, tmp_path):
    """With a draft model (speculative decoding) level 2 frees the draft's weights and KV
    cache as well, and after wake_up the engine gives the same tokens."""
    from portaserve.models.truncated import truncate_checkpoint

    draft = truncate_checkpoint(checkpoint(ARCH), tmp_path / "draft", 2)
    llm = LLM(checkpoint(ARCH), speculative_config={"model": str(draft), "num_speculative_tokens": 3}, **ENGINE_KW)
    try:
        want = reference_ids(PROMPTS, 8, ARCH, 0)
        assert generate_ids(llm, PROMPTS) == want
        runner = llm.llm_engine.core.executor.worker.runner
        kv = _kv_bytes(llm)
        assert kv > sum(t.numel() * t.element_size() for t in runner.kv_caches)  # the draft's cache counts
        released = llm.sleep(level=2)
        assert released["kv_cache_bytes"] == kv
        assert all(p.numel() == 0 for p in runner.drafter.model.parameters())
        assert llm.wake_up()["kv_cache_bytes"] == kv
        assert generate_ids(llm, PROMPTS) == want
        assert llm.llm_engine.stats().spec_num_accepted_tokens > 0
    finally:
        llm.shutdown()
