"""Speculative decoding with a draft model (`{"model": PATH}`): the draft is the target with
its later layers dropped (models/truncated.py), so it is accepted often but not always
(each test asserts 30% to 90%), and every greedy and seeded output is token-identical to
decoding without speculation: in mixed batches, with the prefix cache, under preemption,
with stop strings and max_tokens reached mid-proposal, and on the real default model. A
draft identical to the target is always accepted (the draft's KV bookkeeping is right)."""

from __future__ import annotations

import json

import pytest

from portaserve import LLM, SamplingParams
from portaserve.framework.config import EngineConfig
from portaserve.framework.engine.speculative import SpeculativeConfig
from portaserve.framework.engine.startup import resolve_engine
from portaserve.framework.errors import InvalidParameterError
from portaserve.framework.executor.draft_model import _Progress
from portaserve.models.truncated import truncate_checkpoint
from speculation_helpers import ids, repetitive_prompts, run


# ----- config, bookkeeping, checkpoints (fast) ------------------------------------------------------------


def test_config_takes_a_model_in_vllms_shape():
    config = SpeculativeConfig.parse('{"model": "/m/draft", "num_speculative_tokens": 3}')
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "/m/draft", 3)
    assert SpeculativeConfig.parse(config.to_dict()) == config
    for bad, words in (('{"method": "ngram", "model": "/m"}', "takes a 'model'"),
                       ('{"method": "draft_model"}', "takes a 'model'"),
                       ('{"model": ""}', "non-empty path"), ('{"model": 3}', "non-empty path"),
                       ('{"gguf_file": "d.gguf"}', "takes a 'model'"),
                       ('{"model": "/m", "prompt_lookup_min": 2}', "'ngram' only")):
        with pytest.raises(InvalidParameterError) as err:
            SpeculativeConfig.parse(bad)
        assert err.value.param == "speculative_config" and words in str(err.value), bad


def test_progress_keeps_the_positions_up_to_the_first_rejected_proposal():
    progress = _Progress(valid=4, tail=(7, 8, 9))  # KV of 4 known tokens, then proposals 7 8 9
    assert progress.known_right([1, 2, 3, 4, 7, 8, 5]) == 6  # 7 and 8 accepted, 9 rejected
    assert progress.known_right([1, 2, 3, 4, 6]) == 4  # the first proposal rejected
    assert progress.known_right([1, 2, 3, 4, 7, 8, 9, 2]) == 7  # all accepted
    assert progress.known_right([1, 2, 3, 4, 7]) == 5  # fewer tokens known than written
    assert _Progress().known_right([1, 2]) == 0


def test_truncated_checkpoint_keeps_the_first_layers(checkpoint, tmp_path):
    from safetensors import safe_open

    folder = checkpoint("Qwen2ForCausalLM")
    out = truncate_checkpoint(folder, tmp_path / "draft", 2)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    with safe_open(out / "model.safetensors", "pt") as f:
        layers = {int(k.split(".")[2]) for k in f.keys() if k.startswith("model.layers.")}
        assert layers == {0, 1} and "model.embed_tokens.weight" in f.keys()
    with pytest.raises(ValueError, match="exceeds"):
        truncate_checkpoint(folder, tmp_path / "big", 9)


def test_draft_resolves_on_the_targets_platform_and_checks_the_vocabulary(checkpoint, tmp_path):
    folder = checkpoint("Qwen2ForCausalLM")
    draft = truncate_checkpoint(folder, tmp_path / "draft", 1)
    spec = resolve_engine(EngineConfig(model=folder, block_size=32, max_model_len=256,
                                       speculative_config={"model": str(draft)}))
    assert spec.draft is not None and spec.draft.plan.block_size == 32 and spec.draft.max_model_len == 256
    assert spec.draft.plan.platform.name == spec.plan.platform.name
    other = checkpoint("Qwen2ForCausalLM", config_overrides={"vocab_size": 48}, tokenizer=False)
    # a draft with fewer embedding rows is fine, one with more is not
    assert resolve_engine(EngineConfig(model=folder, speculative_config={"model": other})).draft.vocab_size == 48
    for target, path, words in ((other, folder, "is larger than the target's (48)"),
                                (folder, tmp_path / "nowhere", "nowhere")):
        with pytest.raises(InvalidParameterError) as err:
            resolve_engine(EngineConfig(model=target, speculative_config={"model": str(path)}))
        assert err.value.param == "speculative_config" and words in str(err.value)


# ----- engines (full suite) --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(checkpoint, tmp_path_factory):
    """A 3-layer random Qwen2 whose last layer writes 0.3x its random residual updates, and
    its first 2 layers as the draft: about 55-60% of proposals accepted (a random model's
    later layers dropped outright leave 10-40%)."""
    import shutil

    from safetensors.torch import load_file, save_file

    target = tmp_path_factory.mktemp("spec") / "target"
    shutil.copytree(checkpoint("Qwen2ForCausalLM"), target)
    weights = load_file(target / "model.safetensors")
    for name in weights:
        if name.startswith("model.layers.2.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.3
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return str(target), str(truncate_checkpoint(target, target.parent / "draft", 2))


def draft_config(path, k: int = 4) -> dict:
    return {"model": str(path), "num_speculative_tokens": k}


def acceptance(llm) -> float:
    stats = llm.llm_engine.stats()
    assert stats.spec_num_draft_tokens > 0
    return stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens


@pytest.mark.slow
def test_greedy_seeded_and_logprobs_unchanged_in_mixed_batches(folders):
    target, draft = folders
    prompts = repetitive_prompts(9, seed=1)
    plain = LLM(target, dtype="float32", block_size=16)
    spec = LLM(target, dtype="float32", block_size=16, speculative_config=draft_config(draft))
    for params in (SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=0.02, top_p=0.9, seed=11, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=0.02, presence_penalty=0.1, repetition_penalty=1.02,
                                  seed=3, ignore_eos=True),
                   SamplingParams(max_tokens=37, temperature=0, logprobs=2, ignore_eos=True)):
        want, got = run(plain, prompts, params), run(spec, prompts, params)
        assert ids(got) == ids(want), params
        if params.logprobs:
            for a, b in zip(want, got):
                assert [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)] == pytest.approx(
                    [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)], abs=1e-4)
    # the same prompts again: the target's prefix cache hits, the draft recomputes its own KV
    again = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    assert ids(run(spec, prompts, again)) == ids(run(plain, prompts, again))
    assert spec.llm_engine.stats().prefix_cache_hits > 0
    assert 0.3 <= acceptance(spec) <= 0.9
    # the draft computed each prompt beside the target's prefill: a proposal only ever
    # caught up on a verification's tokens (at most k + 1), never on a prompt
    drafter = spec.llm_engine.core.executor.worker.runner.drafter
    assert 1 <= drafter.num_caught_up <= 5


@pytest.mark.slow
def test_preemption_stop_strings_and_the_last_token(folders):
    target, draft = folders
    prompts = repetitive_prompts(6, seed=2)
    params = SamplingParams(max_tokens=45, temperature=0, ignore_eos=True)
    plain = LLM(target, dtype="float32", block_size=16)
    want = ids(run(plain, prompts, params))
    tight = LLM(target, dtype="float32", block_size=16, num_gpu_blocks_override=15, enable_prefix_caching=False,
                speculative_config=draft_config(draft))
    assert ids(run(tight, prompts, params)) == want
    assert tight.llm_engine.stats().num_preemptions > 0
    assert 0.3 <= acceptance(tight) <= 0.9
    assert tight.llm_engine.core.executor.worker.runner.drafter.num_caught_up <= 5  # resumed prompts too
    spec = LLM(target, dtype="float32", block_size=16, speculative_config=draft_config(draft, k=3))
    probe = run(spec, prompts[:1], params)[0].outputs[0]
    stop = probe.text[9:11]
    with_stop = SamplingParams(max_tokens=45, temperature=0, ignore_eos=True, stop=[stop], logprobs=1)
    a, b = run(plain, prompts[:1], with_stop)[0].outputs[0], run(spec, prompts[:1], with_stop)[0].outputs[0]
    assert (b.text, list(b.token_ids), b.finish_reason) == (a.text, list(a.token_ids), "stop")
    assert len(b.logprobs) == len(b.token_ids)
    for n in (1, 2, 3, 5):
        short = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        assert ids(run(spec, prompts, short)) == ids(run(plain, prompts, short))


@pytest.mark.slow
def test_a_draft_with_fewer_embedding_rows_and_a_grammar_request(folders, tmp_path):
    """A draft padded to fewer rows than the target (Qwen2.5-0.5B against 7B): prompt ids
    past its rows reach it clamped, not as an out-of-range lookup; a request under a
    grammar decodes without proposals beside speculating ones, all as without the draft."""
    import shutil

    from safetensors.torch import load_file, save_file

    from portaserve.framework.structured.params import StructuredOutputsParams

    target, draft = folders
    small = tmp_path / "small-vocab"
    shutil.copytree(draft, small)
    config = json.loads((small / "config.json").read_text())
    rows = config["vocab_size"] - 64
    config["vocab_size"] = rows
    (small / "config.json").write_text(json.dumps(config))
    weights = load_file(small / "model.safetensors")
    weights = {k: (v[:rows] if v.shape[0] == rows + 64 else v) for k, v in weights.items()}
    save_file(weights, small / "model.safetensors", metadata={"format": "pt"})
    prompts = [{"prompt_token_ids": [rows + 5, 300, 301, rows + 7, 300, 301, rows + 5, 300]}, *repetitive_prompts(3, 6)]
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    regex = SamplingParams(max_tokens=30, temperature=0, structured_outputs=StructuredOutputsParams(regex="(ab|cd){3,9}"))
    params = [greedy, regex, greedy, greedy]
    plain = LLM(target, dtype="float32", block_size=16)
    spec = LLM(target, dtype="float32", block_size=16, speculative_config=draft_config(small))
    assert ids(run(spec, prompts, params)) == ids(run(plain, prompts, params))
    assert acceptance(spec) > 0


@pytest.mark.slow
def test_a_draft_identical_to_the_target_is_always_accepted(folders):
    """Every proposal of the target itself (float32, unquantized) is accepted: a draft KV
    entry left stale after a rejection, or written at the wrong slot, would show here."""
    target, _ = folders
    spec = LLM(target, dtype="float32", block_size=16, speculative_config=draft_config(target))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = repetitive_prompts(5, seed=4)
    assert ids(run(spec, prompts, params)) == ids(run(LLM(target, dtype="float32", block_size=16), prompts, params))
    stats = spec.llm_engine.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 100


@pytest.mark.slow
def test_the_default_model_with_a_gguf_draft(smollm2_gguf, tmp_path):
    """SmolLM2-135M-Instruct (Q4_1) with its first 29 of 30 layers as a GGUF draft (the
    quantized tensors copied as stored): greedy and seeded answers token-identical."""
    draft = truncate_checkpoint(smollm2_gguf, tmp_path / "draft.gguf", 29)
    messages = [[{"role": "user", "content": "What is the capital of France? Tell me about it."}],
                [{"role": "user", "content": "Write a python function that checks whether a number is prime."}]]
    plain = LLM(str(smollm2_gguf), max_model_len=1024)
    spec = LLM(str(smollm2_gguf), max_model_len=1024, speculative_config=draft_config(draft))
    for params, conversation in ((SamplingParams(max_tokens=48, temperature=0), messages[0]),
                                 (SamplingParams(max_tokens=48, temperature=0), messages[1]),
                                 (SamplingParams(max_tokens=48, temperature=0.3, seed=5), messages[1])):
        # one stream at a time (which int8 kernel a matmul takes depends on its rows)
        a = plain.chat(conversation, params, use_tqdm=False)[0].outputs[0]
        b = spec.chat(conversation, params, use_tqdm=False)[0].outputs[0]
        assert list(a.token_ids) == list(b.token_ids), (params, a.text, b.text)
    assert 0.3 <= acceptance(spec) <= 0.9
