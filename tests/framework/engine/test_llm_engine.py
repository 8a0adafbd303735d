"""The engine end to end through `LLM`, against transformers and against itself under
different batch compositions, KV budgets and caching settings."""

from __future__ import annotations

import random

import pytest
import torch

from portaserve import LLM, SamplingParams

ARCH = "Qwen2ForCausalLM"


def prompts_of(lengths, seed=0, vocab=150000):
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def folder(checkpoint):
    return checkpoint(ARCH)


@pytest.fixture(scope="module")
def llm(folder):
    engine = LLM(folder, dtype="float32", block_size=16, max_num_batched_tokens=64)
    yield engine
    engine.shutdown()


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(llm):
    stats = llm.llm_engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0, stats


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_mixed_batch_matches_single_runs_and_transformers(llm, folder, hf_model):
    prompts = prompts_of([5, 17, 33, 70, 9, 48, 2, 120], seed=1)
    batch = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(24), use_tqdm=False))
    singles = [token_ids(llm.generate([{"prompt_token_ids": p}], greedy(24), use_tqdm=False))[0] for p in prompts[:3]]
    assert batch[:3] == singles
    ref = hf_model(folder)
    for prompt, ours in zip(prompts, batch):
        assert ours == hf_greedy(ref, prompt, 24), f"prompt of {len(prompt)} tokens diverged from transformers"
    assert sum(len(set(t)) for t in batch) / len(batch) >= 4  # not a degenerate repeat
    assert_all_blocks_free(llm)


@pytest.mark.slow
def test_preemption_gives_identical_outputs(folder):
    prompts = prompts_of([40, 33, 25, 50, 12, 31], seed=2)
    params = greedy(40)
    ample = LLM(folder, dtype="float32", block_size=16)
    want = token_ids(ample.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    ample.shutdown()
    # 14 usable blocks of 16 tokens: two or three sequences at a time, so others are preempted
    tight = LLM(folder, dtype="float32", block_size=16, num_gpu_blocks_override=15, enable_prefix_caching=False)
    got = token_ids(tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    stats = tight.llm_engine.stats()
    assert stats.num_preemptions > 0, "the budget was meant to force preemption"
    assert got == want
    assert_all_blocks_free(tight)
    tight.shutdown()


def test_prefix_cache_hits_and_unchanged_outputs(folder, llm):
    shared = prompts_of([64], seed=3)[0]
    tails = prompts_of([5, 9, 13], seed=4)
    prompts = [{"prompt_token_ids": shared + t} for t in tails]
    before = llm.llm_engine.stats().prefix_cache_hits
    first = token_ids(llm.generate(prompts[:1], greedy(12), use_tqdm=False))
    rest = token_ids(llm.generate(prompts[1:], greedy(12), use_tqdm=False))
    hits = llm.llm_engine.stats().prefix_cache_hits - before
    assert hits >= 2 * 64, f"expected the 64-token prefix served from cache twice, got {hits} tokens"
    nocache = LLM(folder, dtype="float32", block_size=16, enable_prefix_caching=False)
    want = token_ids(nocache.generate(prompts, greedy(12), use_tqdm=False))
    assert nocache.llm_engine.stats().prefix_cache_hits == 0
    nocache.shutdown()
    assert first + rest == want


def test_chunked_prefill_of_a_long_prompt_matches(folder, llm, hf_model):
    # max_num_batched_tokens=64: a 200-token prompt takes four steps while others decode
    long = prompts_of([200], seed=5)[0]
    short = prompts_of([7, 11], seed=6)
    outs = token_ids(llm.generate([{"prompt_token_ids": p} for p in [long, *short]], greedy(10), use_tqdm=False))
    assert outs[0] == hf_greedy(hf_model(folder), long, 10)


@pytest.mark.slow
def test_seeded_sampling_independent_of_batch(llm):
    prompt = {"prompt_token_ids": prompts_of([21], seed=7)[0]}
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = token_ids(llm.generate([prompt], seeded, use_tqdm=False))[0]
    others = [{"prompt_token_ids": p} for p in prompts_of([30, 4, 55], seed=8)]
    mixed_params = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True), seeded, greedy(5), SamplingParams(temperature=1.2, max_tokens=9, seed=7)]
    mixed = token_ids(llm.generate([others[0], prompt, others[1], others[2]], mixed_params, use_tqdm=False))
    assert mixed[1] == alone
    other_seed = token_ids(llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=16, ignore_eos=True), use_tqdm=False))[0]
    assert other_seed != alone


def test_logprobs_are_log_softmax_of_reference_logits(llm, folder, hf_model):
    prompt = prompts_of([13], seed=9)[0]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    completion = out.outputs[0]
    full = prompt + completion.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(folder)(torch.tensor([full])).logits[0].double(), dim=-1)
    for i, (tok, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        pos = len(prompt) - 1 + i
        assert abs(entry[tok].logprob - ref[pos, tok].item()) < 1e-4
        assert entry[tok].rank == 1  # greedy picks the argmax
        top = torch.topk(ref[pos], 3).indices.tolist()
        assert set(entry) == set(top)  # the sampled token is the argmax, so it is one of the top 3
        for t in top:
            assert abs(entry[t].logprob - ref[pos, t].item()) < 1e-4
    assert out.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        entry = out.prompt_logprobs[j]
        assert abs(entry[prompt[j]].logprob - ref[j - 1, prompt[j]].item()) < 1e-4
        assert entry[prompt[j]].rank == int((ref[j - 1] > ref[j - 1, prompt[j]]).sum()) + 1
    assert abs(completion.cumulative_logprob - sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs))) < 1e-6


def test_stop_strings_and_n(llm):
    prompt = {"prompt_token_ids": prompts_of([15], seed=10)[0]}
    base = llm.generate([prompt], greedy(20), use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 8
    stop = text[4:7]
    cut = llm.generate([prompt], greedy(20, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate([prompt], greedy(20, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    # n > 1: n completions per request, each its own sample
    multi = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in multi.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in multi.outputs}) > 1
    again = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in multi.outputs]
    greedy_n = llm.generate([prompt], greedy(8, n=2), use_tqdm=False)[0]
    assert greedy_n.outputs[0].token_ids == greedy_n.outputs[1].token_ids == base.token_ids[:8]
    assert_all_blocks_free(llm)


def test_max_tokens_and_finish_reasons(llm):
    prompt = {"prompt_token_ids": prompts_of([6], seed=11)[0]}
    out = llm.generate([prompt], greedy(5), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    for i, p in enumerate(prompts_of([30, 40, 50], seed=12)):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": p}, greedy(50))
    engine.step()
    engine.step()
    engine.abort_request(["abort-0", "abort-1", "abort-2"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)


def test_validation_errors_name_the_parameter(llm):
    from portaserve.framework.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError) as e:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=10**6), use_tqdm=False)
    assert e.value.param == "max_tokens" and "max_model_len" in str(e.value)
    with pytest.raises(InvalidParameterError) as e:
        llm.generate([{"prompt_token_ids": [10**7]}], greedy(3), use_tqdm=False)
    assert e.value.param == "prompt"
    with pytest.raises(ValueError) as e:
        SamplingParams(temperature=-1)
    assert "temperature" in str(e.value)
    assert_all_blocks_free(llm)


@pytest.mark.slow
def test_prefill_cap_reaches_the_scheduler_and_keeps_outputs(folder):
    """max_prefill_tokens_with_decodes flows config -> ExecutionPlan -> scheduler: with a
    cap of 8, prompts admitted while others decode take more, smaller steps, and greedy
    outputs stay the same as uncapped."""
    prompts = [{"prompt_token_ids": p} for p in prompts_of([6, 40, 33, 50], seed=9)]
    runs = {}
    for cap in (0, 8):
        engine = LLM(folder, dtype="float32", block_size=16, max_num_batched_tokens=32, max_prefill_tokens_with_decodes=cap)
        plan = engine.llm_engine.plan
        assert plan.prefill_cap_with_decodes == (cap or None), plan.prefill_cap
        outputs = token_ids(engine.generate(prompts, greedy(8), use_tqdm=False))
        runs[cap] = (outputs, engine.llm_engine.stats().num_steps)
        assert_all_blocks_free(engine)
        engine.shutdown()
    assert runs[8][0] == runs[0][0]
    assert runs[8][1] > runs[0][1], runs


def test_n_sequences_that_cannot_fit_the_kv_cache_together_are_refused(folder):
    from portaserve.framework.errors import InvalidParameterError

    engine = LLM(folder, dtype="float32", block_size=16, num_gpu_blocks_override=9)  # 8 usable blocks
    try:
        prompt = {"prompt_token_ids": prompts_of([20], seed=3)[0]}
        ok = engine.generate([prompt], SamplingParams(n=2, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
        assert len(ok.outputs) == 2 and all(len(c.token_ids) == 30 for c in ok.outputs)
        with pytest.raises(InvalidParameterError, match="n: 5 sequences") as err:
            engine.generate([prompt], SamplingParams(n=5, max_tokens=30, ignore_eos=True), use_tqdm=False)
        assert err.value.param == "n"
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_a_request_failing_in_the_engine_fails_alone(llm):
    def boom(output_ids, logits):
        if len(output_ids) == 2:
            raise ValueError("boom")
        return logits

    prompts = [{"prompt_token_ids": p} for p in prompts_of([6, 9, 12], seed=21)]
    params = [greedy(6, logits_processors=[boom]), greedy(6), greedy(6, logits_processors=[lambda ids, row: row * float("nan")])]
    failed, healthy, nan = llm.generate(prompts, params, use_tqdm=False)
    assert failed.error and "boom" in failed.error and failed.outputs[0].finish_reason == "error"
    assert len(failed.outputs[0].token_ids) == 2  # what it made before the fault
    assert healthy.error is None and len(healthy.outputs[0].token_ids) == 6
    assert healthy.outputs[0].token_ids == token_ids(llm.generate([prompts[1]], greedy(6), use_tqdm=False))[0]
    assert nan.error and "no finite value" in nan.error
    assert_all_blocks_free(llm)
