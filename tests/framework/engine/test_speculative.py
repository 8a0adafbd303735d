"""Speculative decoding (n-gram proposals): token-identical greedy and seeded outputs with
and without it, in mixed batches, under preemption, with stop strings, max_tokens reached
mid-proposal and logprobs; unseeded sampling keeps the target distribution (a chi-square
test that fails on a biased acceptance rule); and the proposer and config on their own."""

from __future__ import annotations

import pytest

from portaserve import LLM, SamplingParams
from portaserve.framework.engine.speculative import NgramProposer, SpeculativeConfig, next_num_drafts
from portaserve.framework.errors import InvalidParameterError
from speculation_helpers import ids, repetitive_prompts, run

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


# ----- the proposer and the config (fast) ----------------------------------------------------------------


def test_ngram_proposes_the_continuation_of_the_latest_match():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3))
    #            the last 3 tokens (7 8 9) occur earlier twice; the latest one wins
    tokens = [7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 0, 7, 8, 9]
    assert proposer.propose(tokens, 3) == (4, 5, 6)
    assert proposer.propose(tokens, 2) == (4, 5)
    assert proposer.propose([1, 2, 3, 4, 5], 3) == ()  # no earlier match
    assert proposer.propose([5, 6, 1, 5, 6], 3) == (1, 5, 6)  # a 2-gram match when no 3-gram does
    assert proposer.propose([5, 6, 1, 5, 6], 0) == ()
    assert proposer.propose([3, 3], 2) == ()  # shorter than the n-gram plus one token


def test_config_in_vllms_shape_and_errors_naming_the_key():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5}').num_speculative_tokens == 5
    assert SpeculativeConfig.parse(None) is None
    for bad, words in (('{"method": "eagle"}', "method 'eagle'"), ('{"num_speculative_tokens": 0}', "[1, 64]"),
                       ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "exceeds"), ("[1]", "JSON object"),
                       ('{"k": 3}', "unknown key"), ("{", "not valid JSON")):
        with pytest.raises(InvalidParameterError) as err:
            SpeculativeConfig.parse(bad)
        assert err.value.param == "speculative_config" and words in str(err.value), bad
    with pytest.raises(InvalidParameterError, match="speculative_config"):
        LLM(model=None, speculative_config={"method": "nope"})


def test_fewer_proposals_after_rejections():
    assert next_num_drafts(4, 4, 4) == 4  # all accepted: all again
    assert next_num_drafts(4, 0, 4) == 1
    assert next_num_drafts(4, 2, 4) == 3
    assert next_num_drafts(1, 1, 4) == 4


# ----- engines (full suite) --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(checkpoint):
    return checkpoint("Qwen2ForCausalLM")


@pytest.mark.slow
def test_greedy_and_seeded_outputs_are_unchanged_in_mixed_batches(folder):
    prompts = repetitive_prompts(9, seed=1)
    plain = LLM(folder, dtype="float32", block_size=16)
    spec = LLM(folder, dtype="float32", block_size=16, speculative_config=NGRAM)
    for params in (SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                   # low temperatures (the random model's logits are flat): the samples follow its loops, so proposals are made
                   # and accepted, and each seeded draw must still be the same
                   SamplingParams(max_tokens=40, temperature=0.02, top_p=0.9, seed=11, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=0.02, presence_penalty=0.1, repetition_penalty=1.02,
                                  seed=3, ignore_eos=True),
                   SamplingParams(max_tokens=37, temperature=0, logprobs=2, ignore_eos=True)):
        before = spec.llm_engine.stats()
        want, got = run(plain, prompts, params), run(spec, prompts, params)
        assert ids(got) == ids(want), params
        after = spec.llm_engine.stats()
        proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        assert proposed > 0 and accepted > 0, params  # speculation did run, and did accept
        if params.logprobs:
            for a, b in zip(want, got):
                assert [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)] == pytest.approx(
                    [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)], abs=1e-4)
    # a random model's loops accept often, but not always: both paths of the rule ran
    stats = spec.llm_engine.stats()
    assert 0.3 * stats.spec_num_draft_tokens <= stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


@pytest.mark.slow
def test_preemption_stop_strings_and_the_last_token(folder, checkpoint):
    prompts = repetitive_prompts(6, seed=2)
    params = SamplingParams(max_tokens=45, temperature=0, ignore_eos=True)
    want = ids(run(LLM(folder, dtype="float32", block_size=16), prompts, params))
    tight = LLM(folder, dtype="float32", block_size=16, num_gpu_blocks_override=15, enable_prefix_caching=False,
                speculative_config=NGRAM)
    assert ids(run(tight, prompts, params)) == want
    assert tight.llm_engine.stats().num_preemptions > 0
    # stop strings end the text mid-step: the same text and finish as without speculation
    text_folder = checkpoint("Qwen2ForCausalLM")
    plain = LLM(text_folder, dtype="float32")
    spec = LLM(text_folder, dtype="float32", speculative_config=NGRAM)
    probe = run(plain, prompts[:1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].outputs[0].text
    stop = probe[len(probe) // 2: len(probe) // 2 + 3]
    stopped = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    a, b = run(plain, prompts[:1], stopped)[0].outputs[0], run(spec, prompts[:1], stopped)[0].outputs[0]
    assert (a.text, a.finish_reason, a.stop_reason) == (b.text, b.finish_reason, b.stop_reason) and a.finish_reason == "stop"
    # max_tokens reached in the middle of accepted proposals: exactly max_tokens tokens
    for n in (1, 2, 3, 5, 7):
        short = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        assert ids(run(spec, prompts, short)) == ids(run(plain, prompts, short))


def _token_counts(llm, n: int, biased: bool, monkeypatch) -> list[int]:
    """How many distinct tokens each of n unseeded 10-token samples holds (temperature 1: a
    sampled token seen earlier makes the proposer offer what followed it, which the model
    rarely samples again, so a rule that keeps proposals unchecked copies its context and
    samples hold fewer distinct tokens; the token frequencies alone do not show it)."""
    from portaserve.framework.executor import speculation

    if biased:  # a wrong rule: accept every proposal (as if the check were left out)
        real = speculation.verify

        def biased_verify(runner, inputs, hidden, prompt_logprobs, drafts):
            sampler, make_metadata = runner.sampler, runner.sampling.make_metadata
            rows: list[str] = []

            def metadata(ids, device):
                rows[:] = ids
                return make_metadata(ids, device)

            def lenient(logits, meta):
                out = sampler(logits, meta)
                for row, rid in enumerate(rows):
                    proposal = drafts.get(rid, ())
                    if not proposal:
                        continue
                    position = runner.sampling.num_output_tokens(rid) - state_outputs[rid]
                    if position < len(proposal):
                        out.sampled_token_ids[row] = proposal[position]
                return out

            state_outputs = {rid: runner.sampling.num_output_tokens(rid) for rid in drafts}
            runner.sampler, runner.sampling.make_metadata = lenient, metadata
            try:
                return real(runner, inputs, hidden, prompt_logprobs, drafts)
            finally:
                runner.sampler, runner.sampling.make_metadata = sampler, make_metadata

        monkeypatch.setattr("portaserve.framework.executor.model_runner.verify", biased_verify)
    cycle = [3, 17, 29, 8, 41, 12, 36, 5, 22, 44, 9, 31, 14, 27, 38, 2]
    prompt = {"prompt_token_ids": cycle * 2 + cycle[:3]}
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    outs = run(llm, [prompt] * n, params)
    counts = [0] * 11
    for o in outs:  # the whole sequence's law, seen through how many distinct tokens it holds
        counts[len(set(o.outputs[0].token_ids))] += 1
    return counts


def chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of a chi-square test that two count vectors come from one distribution
    (categories with fewer than 5 expected counts pooled)."""
    from scipy.stats import chi2_contingency

    pooled_a, pooled_b, rest_a, rest_b = [], [], 0, 0
    for x, y in zip(a, b):
        if x + y >= 10:
            pooled_a.append(x)
            pooled_b.append(y)
        else:
            rest_a, rest_b = rest_a + x, rest_b + y
    if rest_a + rest_b:
        pooled_a.append(rest_a)
        pooled_b.append(rest_b)
    return float(chi2_contingency([pooled_a, pooled_b])[1])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_unseeded_sampling_keeps_the_target_distribution(method, checkpoint, monkeypatch, tmp_path):
    """A 48-token vocabulary, 3000 samples of 10 tokens with and without speculation: one
    distribution (of the samples' distinct-token counts); a rule that accepts proposals
    without the check is caught. The draft model is the target's first 2 of 3 layers."""
    from portaserve.models.truncated import truncate_checkpoint

    small = checkpoint("Qwen2ForCausalLM", config_overrides={"vocab_size": 48}, tokenizer=False)
    kw = dict(dtype="float32", skip_tokenizer_init=True, max_num_seqs=256, seed=0)
    plain = LLM(small, **kw)
    config = ({**NGRAM, "prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else
              {"model": str(truncate_checkpoint(small, tmp_path / "draft", 2)), "num_speculative_tokens": 4})
    spec = LLM(small, speculative_config=config, **kw)
    base = _token_counts(plain, 3000, False, monkeypatch)
    fair = _token_counts(spec, 3000, False, monkeypatch)
    stats = spec.llm_engine.stats()
    assert stats.spec_num_draft_tokens > 3000 and stats.spec_num_accepted_tokens > 30  # the rule ran both ways
    assert chi_square_p(base, fair) > 1e-3
    biased = _token_counts(spec, 3000, True, monkeypatch)
    assert chi_square_p(base, biased) < 1e-3


@pytest.mark.slow
def test_the_default_model_gives_the_same_text(smollm2_gguf):
    """SmolLM2-135M-Instruct (Q4_1, bfloat16 activations): repeating a code snippet,
    greedy and seeded, token-identical with n-gram speculation, which accepts often."""
    code = "def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n" \
           "    return 2 * (width + height)\n"
    messages = [{"role": "user", "content": "Repeat this Python code exactly, without changes:\n\n" + code}]
    plain = LLM(str(smollm2_gguf), max_model_len=1024)
    spec = LLM(str(smollm2_gguf), max_model_len=1024, speculative_config=NGRAM)
    for params in (SamplingParams(max_tokens=60, temperature=0),
                   SamplingParams(max_tokens=60, temperature=0.3, seed=5)):
        a = plain.chat(messages, params, use_tqdm=False)[0].outputs[0]
        b = spec.chat(messages, params, use_tqdm=False)[0].outputs[0]
        assert list(a.token_ids) == list(b.token_ids) and "perimeter" in a.text, params
    stats = spec.llm_engine.stats()
    assert 0.3 * stats.spec_num_draft_tokens <= stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


@pytest.mark.slow
def test_grammar_constrained_proposals(folder):
    """Requests under a grammar speculate too: their proposals are cut where the grammar
    refuses them and each verified position samples under its own mask row, so greedy and
    seeded constrained outputs are token-identical, beside unconstrained requests."""
    from portaserve.framework.structured.params import StructuredOutputsParams

    regex = StructuredOutputsParams(regex="(yes|no|maybe)(, (yes|no|maybe)){5,40}\\.")
    schema = StructuredOutputsParams(json={"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                           "minItems": 4, "maxItems": 30}, disable_any_whitespace=True)
    prompts = repetitive_prompts(6, seed=8)
    plain = LLM(folder, dtype="float32", block_size=16)
    spec = LLM(folder, dtype="float32", block_size=16, speculative_config=NGRAM)
    for kw in (dict(temperature=0), dict(temperature=0.05, seed=9)):
        constrained = [SamplingParams(max_tokens=60, structured_outputs=c, **kw) for c in (regex, schema)]
        params = [*constrained, SamplingParams(max_tokens=30, ignore_eos=True, **kw)] * 2
        before = spec.llm_engine.stats().spec_num_accepted_tokens
        want, got = run(plain, prompts, params), run(spec, prompts, params)
        assert ids(got) == ids(want), kw
        assert got[0].outputs[0].text.endswith(".") and got[1].outputs[0].text.startswith("[")
        assert spec.llm_engine.stats().spec_num_accepted_tokens > before
    # the constrained requests alone: their own proposals were accepted
    before = spec.llm_engine.stats()
    only = [SamplingParams(max_tokens=60, temperature=0, structured_outputs=c) for c in (regex, schema)]
    assert ids(run(spec, prompts[:2], only)) == ids(run(plain, prompts[:2], only))
    after = spec.llm_engine.stats()
    assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens > 5


@pytest.mark.slow
def test_structured_outputs_and_priority_preemption_beside_proposals(folder):
    """A request under a grammar keeps its mask in a step whose other requests verify
    proposals; a priority preemption of a request scheduled with proposals this step drops
    them too."""
    from portaserve.framework.structured.params import StructuredOutputsParams

    prompts = repetitive_prompts(4, seed=5)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=30, temperature=0, structured_outputs=StructuredOutputsParams(
        regex="(yes|no), [0-9]{3}"))
    plain = LLM(folder, dtype="float32", block_size=16)
    spec = LLM(folder, dtype="float32", block_size=16, speculative_config=NGRAM)
    params = [greedy, constrained, greedy, greedy]
    want, got = run(plain, prompts, params), run(spec, prompts, params)
    assert ids(got) == ids(want)
    assert got[1].outputs[0].finish_reason == "stop" and got[1].outputs[0].text[:2] in ("ye", "no")
    # priority: later requests are more urgent and preempt running ones (two sequences at most)
    kw = dict(dtype="float32", block_size=16, max_num_seqs=2, scheduling_policy="priority")
    prio_plain, prio_spec = LLM(folder, **kw), LLM(folder, speculative_config=NGRAM, **kw)
    order = list(range(len(prompts)))[::-1]
    a = prio_plain.generate(prompts, greedy, priority=order, use_tqdm=False)
    b = prio_spec.generate(prompts, greedy, priority=order, use_tqdm=False)
    assert ids(a) == ids(b)


@pytest.mark.slow
def test_a_stop_string_inside_accepted_proposals_cuts_the_tokens_too(checkpoint):
    """With several tokens per step, the tokens after a stop string are not output: the
    token ids, their count in usage and the logprobs end where the text does."""
    text_folder = checkpoint("Qwen2ForCausalLM")
    plain = LLM(text_folder, dtype="float32")
    spec = LLM(text_folder, dtype="float32", speculative_config=NGRAM)
    prompt = [{"prompt_token_ids": [900, 901, 902, 900, 901, 902, 900, 901]}]
    probe = run(spec, prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].outputs[0]
    assert spec.llm_engine.stats().spec_num_accepted_tokens > 3
    for cut in (5, 11, 17):
        stop = probe.text[cut:cut + 2]
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop], logprobs=1)
        a, b = run(plain, prompt, params)[0].outputs[0], run(spec, prompt, params)[0].outputs[0]
        assert (b.text, list(b.token_ids), b.finish_reason) == (a.text, list(a.token_ids), a.finish_reason)
        assert len(b.logprobs) == len(b.token_ids)
