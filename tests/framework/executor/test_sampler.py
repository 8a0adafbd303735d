"""The sampler and its per-request state, against a naive per-row float64 reference.

The reference below applies each transform of sampler.py's documented order to one
row at a time in plain Python / float64, so every batched tensor trick in the sampler
is checked against the obvious implementation.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from portaserve.framework.engine.params import SamplingParams
from portaserve.framework.executor.sampler import (
    BLOCK_REDUCTIONS,
    REUSE_BUFFERS,
    Sampler,
    argmax_rows,
    compute_prompt_logprobs,
    topk_rows,
)
from portaserve.framework.executor.sampling_state import SamplingState, seeded_uniform

EOS = 0
#: what the CPU platform declares: the sampler's host fast paths, tested here
HOST = frozenset({BLOCK_REDUCTIONS, REUSE_BUFFERS})


# ----- the naive reference -----------------------------------------------------------


def ref_processed(raw: torch.Tensor, p: SamplingParams, prompt: list[int], outputs: list[int],
                  eos: frozenset[int] = frozenset({EOS})) -> torch.Tensor:
    """Steps 3-7 of the documented order for one row, float64."""
    v = raw.double().clone()
    vocab = v.numel()
    if p.allowed_token_ids:
        for t in range(vocab):
            if t not in p.allowed_token_ids:
                v[t] = -math.inf
    if len(outputs) < p.min_tokens:
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        for t in stops:
            v[t] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        v[t] += b
    for proc in p.logits_processors or []:
        v = proc(list(outputs), v)
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(outputs):
            v[t] = v[t] / p.repetition_penalty if v[t] > 0 else v[t] * p.repetition_penalty
    for t in set(outputs):
        v[t] -= p.frequency_penalty * outputs.count(t)
        v[t] -= p.presence_penalty
    return v


def ref_distribution(processed: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Steps 9-11 for one row: the final sampling probabilities, float64."""
    z = [float(x) / p.temperature for x in processed]
    vocab = len(z)
    top = max(z)
    probs = [math.exp(x - top) for x in z]
    total = sum(probs)
    probs = [q / total for q in probs]
    if p.min_p > 0:
        pmax = max(probs)
        probs = [0.0 if q < p.min_p * pmax else q for q in probs]
    order = sorted(range(vocab), key=lambda t: (-z[t], t))  # canonical: value desc, id asc
    if p.top_k > 0:
        kth = z[order[min(p.top_k, vocab) - 1]]
        probs = [0.0 if z[t] < kth else probs[t] for t in range(vocab)]
    total = sum(probs)
    probs = [q / total for q in probs]
    if p.top_p < 1.0:
        kept = [0.0] * vocab
        before = 0.0
        for t in order:
            if before < p.top_p:
                kept[t] = probs[t]
            before += probs[t]
        total = sum(kept)
        probs = [q / total for q in kept]
    return torch.tensor(probs, dtype=torch.float64)


def one_step(params: list[SamplingParams], logits: torch.Tensor, prompts=None, outputs=None,
             sampler: Sampler | None = None, eos=frozenset({EOS})):
    state = SamplingState()
    ids = [f"r{i}" for i in range(len(params))]
    for i, (rid, p) in enumerate(zip(ids, params)):
        state.add_request(rid, p, prompts[i] if prompts else [], outputs[i] if outputs else [], eos)
    meta = state.make_metadata(ids, logits.device)
    return (sampler or Sampler(features=HOST))(logits, meta), meta


def special_params() -> list[tuple[SamplingParams, list[int], list[int]]]:
    """(params, prompt, outputs) rows exercising every logits edit."""
    return [
        (SamplingParams(temperature=0), [3, 4, 5], [6, 6, 7]),
        (SamplingParams(temperature=0, repetition_penalty=1.7), [3, 4, 5, 9], [6, 6, 7, 3]),
        (SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.7), [1, 2], [8, 8, 8, 2, 11]),
        (SamplingParams(temperature=0, repetition_penalty=0.6, frequency_penalty=-0.5,
                        presence_penalty=-1.0), [10, 12, 0], [12, 13, 13, 0]),  # 0 is also the padding id
        (SamplingParams(temperature=0, logit_bias={5: 4.0, 17: -100.0, 2: 1.5}), [], [1]),
        (SamplingParams(temperature=0, allowed_token_ids=[2, 9, 15, 0]), [], []),
        (SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4, 7]), [], [1, 2]),
        (SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[4], ignore_eos=True), [], [1]),
        (SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4]), [], [1, 2]),  # min reached
        (SamplingParams(temperature=0, allowed_token_ids=[0, 3, 4], min_tokens=5, stop_token_ids=[3],
                        logit_bias={4: -2.0}, repetition_penalty=1.3), [4], [9]),
    ]


# ----- logits edits and greedy ---------------------------------------------------------


def test_processed_logits_match_reference():
    torch.manual_seed(0)
    rows = special_params()
    vocab = 20
    logits = torch.randn(len(rows), vocab) * 2
    logits[:, EOS] = 6.0  # EOS is the argmax, so the min_tokens mask matters
    state = SamplingState()
    for i, (p, prompt, out) in enumerate(rows):
        state.add_request(f"r{i}", p, prompt, out, frozenset({EOS}))
    meta = state.make_metadata([f"r{i}" for i in range(len(rows))], "cpu")
    got = Sampler(features=HOST).processed_logits(logits, meta)
    for i, (p, prompt, out) in enumerate(rows):
        want = ref_processed(logits[i], p, prompt, out)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), i
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[i][fin].double(), want[fin], rtol=1e-6, atol=1e-5)
    assert torch.isinf(got[6, EOS]) and torch.isinf(got[6, 4]) and torch.isinf(got[6, 7])
    assert torch.isfinite(got[7, EOS]) and torch.isinf(got[7, 4])  # ignore_eos: EOS not masked
    assert torch.isfinite(got[8, EOS])  # min_tokens reached


def test_greedy_is_argmax_of_reference_logits_in_a_mixed_batch():
    torch.manual_seed(1)
    rows = special_params()
    vocab = 20
    random_row = (SamplingParams(temperature=0.8, top_p=0.9, seed=5), [], [])
    rows = rows[:3] + [random_row] + rows[3:] + [random_row]
    logits = torch.randn(len(rows), vocab) * 2
    logits[:, EOS] = 6.0
    out, meta = one_step([r[0] for r in rows], logits, [r[1] for r in rows], [r[2] for r in rows])
    assert not meta.all_greedy and not meta.all_random
    for i, (p, prompt, outputs) in enumerate(rows):
        if p.temperature == 0:
            want = int(torch.argmax(ref_processed(logits[i], p, prompt, outputs)))
            assert int(out.sampled_token_ids[i]) == want, i


def test_block_argmax_equals_torch_argmax_with_ties():
    gen = torch.Generator().manual_seed(2)
    for vocab in (8192, 10000, 151936 // 8):
        x = (torch.randn(6, vocab, generator=gen) * 2).round()  # many tied maxima
        x[1] = float("-inf")
        x[2, -1] = 100.0  # the maximum in the ragged last block
        x[3, :] = 1.0
        assert torch.equal(argmax_rows(x, blocked=True), x.argmax(dim=-1)), vocab
        assert argmax_rows(x, blocked=True)[1] == 0 and argmax_rows(x, blocked=True)[3] == 0


@pytest.mark.parametrize("vocab", [4096, 5000, 151936 // 16])
def test_block_topk_keeps_every_value_above_the_kth(vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=gen) * 3
    x[1] = (x[1]).round()  # heavy ties
    x[2, -3:] = 50.0  # maxima in the ragged tail
    x[3, : vocab - 7] = float("-inf")  # fewer finite values than k
    for k in (1, 9, 16):
        vals, ids = topk_rows(x, k, blocked=True)
        want = torch.topk(x, k, dim=-1).values
        assert torch.equal(vals, want), k
        assert torch.equal(x.gather(1, ids), vals) and int(ids.max()) < vocab
        for r in range(5):
            assert len(set(ids[r].tolist())) == k  # no duplicates
            above = set(torch.nonzero(x[r] > vals[r, -1]).view(-1).tolist())
            assert above <= set(ids[r].tolist())


def test_host_fast_paths_sample_what_torch_kernels_do():
    """A platform without the CPU's sampler features (an accelerator) takes torch's argmax,
    topk and a fresh buffer per use; the tokens and logprobs are the same."""
    gen = torch.Generator().manual_seed(7)
    vocab = 151936 // 8
    logits = torch.randn(6, vocab, generator=gen) * 3
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.8, top_k=40, seed=1, logprobs=2),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2), SamplingParams(temperature=0.7, seed=3),
              SamplingParams(temperature=0, repetition_penalty=1.2), SamplingParams(temperature=1.0, min_p=0.1, seed=4)]
    host, _ = one_step(params, logits, sampler=Sampler(features=HOST))
    plain, _ = one_step(params, logits, sampler=Sampler())
    assert torch.equal(host.sampled_token_ids, plain.sampled_token_ids)
    assert torch.equal(host.top_token_ids, plain.top_token_ids) and torch.equal(host.ranks, plain.ranks)
    torch.testing.assert_close(host.logprobs, plain.logprobs)


def test_all_greedy_builds_no_tensors():
    logits = torch.randn(5, 50)
    out, meta = one_step([SamplingParams(temperature=0)] * 5, logits)
    assert meta.all_greedy and meta.no_penalties and meta.max_num_logprobs is None
    assert meta.plain is None and meta.truncated is None and not meta.needs_logits_edit
    assert out.logprobs is None
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.device.type == "cpu" and out.sampled_token_ids.dtype == torch.int64


def test_bf16_logits_are_not_modified():
    logits = torch.randn(3, 40).bfloat16()
    before = logits.clone()
    params = [SamplingParams(temperature=0, logit_bias={3: 50.0}), SamplingParams(temperature=1.2, seed=1),
              SamplingParams(top_k=3, seed=2, repetition_penalty=2.0)]
    out, _ = one_step(params, logits, [[1]] * 3, [[2]] * 3)
    assert torch.equal(logits, before)
    assert int(out.sampled_token_ids[0]) == 3


def test_logits_processor_forcing_a_token():
    seen = []

    def force_7(output_ids, row):
        seen.append(list(output_ids))
        row = torch.full_like(row, float("-inf"))
        row[7] = 0.0
        return row

    params = [SamplingParams(temperature=1.0, seed=3, logits_processors=[force_7]),
              SamplingParams(temperature=0, logits_processors=[force_7], presence_penalty=1.0),
              SamplingParams(temperature=1.0, top_p=0.5)]
    logits = torch.randn(3, 30)
    out, _ = one_step(params, logits, outputs=[[1, 2], [7], []])
    assert out.sampled_token_ids[:2].tolist() == [7, 7]
    assert seen == [[1, 2], [7]]


# ----- supports and distributions ------------------------------------------------------


DIST_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=0.9, min_p=0.15),
    SamplingParams(temperature=1.1, top_k=6, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.8, top_p=0.95, presence_penalty=1.0, logit_bias={2: 1.0}),
]


@pytest.mark.parametrize("case", range(len(DIST_CASES)))
def test_support_and_distribution_match_reference(case):
    base = DIST_CASES[case]
    vocab = 12
    num_draws = 6000
    gen = torch.Generator().manual_seed(case)
    row = torch.randn(vocab, generator=gen) * 1.5
    outputs = [3, 3, 5]
    want = ref_distribution(ref_processed(row, base, [], outputs), base)
    # every draw is its own seeded row of one big batch
    params = []
    for s in range(num_draws):
        p = copy.copy(base)  # the state digests params when a row is added
        p.seed = 1000 * case + s
        params.append(p)
    logits = row.expand(num_draws, vocab).contiguous()
    out, _ = one_step(params, logits, outputs=[outputs] * num_draws)
    tokens = out.sampled_token_ids
    support = set(torch.nonzero(want > 0).view(-1).tolist())
    assert set(tokens.tolist()) <= support
    freq = torch.bincount(tokens, minlength=vocab).double() / num_draws
    tv = 0.5 * (freq - want).abs().sum()
    assert tv < 0.035, (tv, freq, want)
    # chi-square over the support (bins with expected count >= 5)
    expected = want * num_draws
    counts = freq * num_draws
    bins = expected >= 5
    chi2 = float((((counts - expected) ** 2) / expected)[bins].sum())
    dof = int(bins.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * max(dof, 1)) + 10, (chi2, dof)


def test_a_top_p_that_underflows_float32_keeps_the_top_token():
    """Found by the fuzzer: top_p=5e-324 is 0 in float32, and the cut kept nothing (a 500)."""
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0], [2.0, 2.0, 0.0, 1.0]])
    params = [SamplingParams(top_p=5e-324, seed=0), SamplingParams(top_p=5e-324, seed=1)]
    out, _ = one_step(params, logits)
    assert out.sampled_token_ids.tolist() == [1, 0]  # the top token (first on a tie)


def test_top_p_boundary_and_tie_order():
    """Equal logits: 0.25 each. top_p=0.5 keeps the first two in canonical (id) order, as
    vLLM drops a token once the mass ranked above it reaches top_p."""
    vocab = 4
    params = [SamplingParams(top_p=0.5, seed=s) for s in range(200)]
    params += [SamplingParams(top_k=1, seed=s) for s in range(50)]
    params += [SamplingParams(top_p=0.75, seed=s) for s in range(200)]
    out, _ = one_step(params, torch.zeros(len(params), vocab))
    toks = out.sampled_token_ids.tolist()
    assert set(toks[:200]) == {0, 1}
    assert set(toks[200:250]) == {0, 1, 2, 3}  # top_k keeps every token tied with the k-th
    assert set(toks[250:]) == {0, 1, 2}


def test_unseeded_rows_follow_the_distribution():
    torch.manual_seed(123)
    vocab = 8
    row = torch.randn(vocab)
    p = SamplingParams(temperature=1.0, top_k=5)
    want = ref_distribution(ref_processed(row, p, [], []), p)
    n = 6000
    out, _ = one_step([p] * n, row.expand(n, vocab).contiguous())
    freq = torch.bincount(out.sampled_token_ids, minlength=vocab).double() / n
    assert set(out.sampled_token_ids.tolist()) <= set(torch.nonzero(want).view(-1).tolist())
    assert 0.5 * (freq - want).abs().sum() < 0.035


def _large_vocab_logits(num_rows: int, vocab: int, seed: int, ties: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, vocab, generator=gen)
    # a few rows peaked, a few flat: the candidate set fits some and not others
    x[::3] *= 6.0
    x[1::3] *= 0.3
    if ties:
        x = (x * 2).round() / 2  # many exact ties, like bf16 logits
    return x


@pytest.mark.parametrize("ties", [False, True])
def test_candidate_stages_give_the_full_sort_result(ties):
    vocab = 3000
    params = []
    for i in range(24):
        kind = i % 6
        params.append([
            SamplingParams(top_p=0.9, seed=i),
            SamplingParams(top_k=40, seed=i, temperature=0.7),
            SamplingParams(top_k=700, top_p=0.5, seed=i),
            SamplingParams(top_p=0.3, min_p=0.2, seed=i),
            SamplingParams(top_k=2999, seed=i),
            SamplingParams(top_k=5000, top_p=0.99, seed=i),
        ][kind])
    logits = _large_vocab_logits(len(params), vocab, 7, ties)
    small, _ = one_step(params, logits, sampler=Sampler(num_candidates=8, features=HOST))
    full, _ = one_step(params, logits, sampler=Sampler(num_candidates=vocab, features=HOST))
    default, _ = one_step(params, logits)
    assert torch.equal(small.sampled_token_ids, full.sampled_token_ids)
    assert torch.equal(default.sampled_token_ids, full.sampled_token_ids)
    for i, p in enumerate(params):
        want = ref_distribution(ref_processed(logits[i], p, [], []), p)
        assert want[int(full.sampled_token_ids[i])] > 0, i


def test_top_p_cut_on_a_value_tied_beyond_the_candidates():
    """The cut lands on a value shared by more tokens than the candidate set holds: the
    kept tied token must be the smallest id (canonical order), not whichever tie topk kept."""
    vocab = 40
    gen = torch.Generator().manual_seed(11)
    rows, supports = [], []
    for r in range(60):
        x = torch.full((vocab,), -1.0)
        perm = torch.randperm(vocab, generator=gen).tolist()
        top, tied = perm[0], perm[1:5]
        x[top] = 3.0
        x[tied] = 2.0
        rows.append(x)
        supports.append({top, min(tied)})
    logits = torch.stack(rows)
    # masses 1 : 4 x e^-1 : 35 x e^-4 (total 3.11): top_p=0.4 keeps the top and one tied token
    params = [SamplingParams(top_p=0.4, seed=s) for s in range(60)]
    out, _ = one_step(params, logits, sampler=Sampler(num_candidates=3, features=HOST))
    for i, t in enumerate(out.sampled_token_ids.tolist()):
        want = ref_distribution(ref_processed(logits[i], params[i], [], []), params[i])
        assert set(torch.nonzero(want).view(-1).tolist()) == supports[i]
        assert t in supports[i], i


def test_inverse_cdf_picks_the_reference_token_for_the_row_uniform():
    """With the uniform known, the drawn token is the reference's canonical-order quantile."""
    vocab = 300
    gen = torch.Generator().manual_seed(3)
    x = ((torch.randn(40, vocab, generator=gen) * 2) * 2).round() / 2  # ties
    params = [[SamplingParams(top_p=0.8, seed=i), SamplingParams(top_k=9, seed=i),
               SamplingParams(min_p=0.1, top_p=0.95, seed=i, temperature=0.5)][i % 3] for i in range(40)]
    out, _ = one_step(params, x, sampler=Sampler(num_candidates=4, features=HOST))
    for i, p in enumerate(params):
        probs = ref_distribution(ref_processed(x[i], p, [], []), p)
        z = x[i].double() / p.temperature
        order = sorted(range(vocab), key=lambda t: (-float(z[t]), t))
        u = seeded_uniform(p.seed, 0)
        acc = 0.0
        pick = None
        for t in order:
            acc += float(probs[t])
            if probs[t] > 0 and acc > u:
                pick = t
                break
        assert int(out.sampled_token_ids[i]) == pick, i


# ----- seeds -----------------------------------------------------------------------------


def _step_logits(req: str, step: int, vocab: int) -> torch.Tensor:
    """Deterministic fake model logits for (request, step)."""
    g = torch.Generator().manual_seed(sum(map(ord, req)) * 1000 + step)
    return torch.randn(vocab, generator=g) * 2


def _decode(runs: dict[str, SamplingParams], order_per_step, num_steps: int, vocab: int = 64,
            preempt_at: int | None = None, preempt: str | None = None) -> dict[str, list[int]]:
    """Run a fake decode loop; `order_per_step(step)` gives the batch (req ids) of each step."""
    state = SamplingState()
    sampler = Sampler(features=HOST)
    outs: dict[str, list[int]] = {r: [] for r in runs}
    prompts = {r: [1 + i, 2 + i] for i, r in enumerate(runs)}
    for r, p in runs.items():
        state.add_request(r, p, prompts[r], [], frozenset({EOS}))
    for step in range(num_steps):
        if preempt_at is not None and step == preempt_at:
            state.remove_request(preempt)  # preempted, then recomputed with its outputs
            state.add_request(preempt, runs[preempt], prompts[preempt], outs[preempt], frozenset({EOS}))
        batch = order_per_step(step)
        logits = torch.stack([_step_logits(r, len(outs[r]), vocab) for r in batch])
        res = sampler(logits, state.make_metadata(batch, "cpu"))
        for r, t in zip(batch, res.sampled_token_ids.tolist()):
            outs[r].append(t)
            state.append_output(r, t)
    return outs


def test_seeded_rows_ignore_batch_composition_and_preemption():
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=30, seed=42, presence_penalty=0.3)
    target_plain = SamplingParams(temperature=1.0, seed=7)
    others = {
        "g": SamplingParams(temperature=0),
        "u1": SamplingParams(temperature=1.0),
        "u2": SamplingParams(temperature=0.5, top_p=0.8),
        "s": SamplingParams(temperature=1.0, seed=42, min_p=0.05),
        "pen": SamplingParams(temperature=0.7, repetition_penalty=1.4, logprobs=2),
    }
    steps = 12
    alone = _decode({"t": target, "tp": target_plain}, lambda s: ["t", "tp"], steps)
    alone_t = _decode({"t": target}, lambda s: ["t"], steps)  # batch size 1
    everyone = {"t": target, "tp": target_plain, **others}
    names = list(everyone)

    def shuffled(step):  # the rows move around and batch sizes change between 2 and 7
        g = torch.Generator().manual_seed(step)
        perm = [names[i] for i in torch.randperm(len(names), generator=g).tolist()]
        keep = perm[: 2 + step % 6]
        for must in ("t", "tp"):
            if must not in keep:
                keep.insert(int(torch.randint(0, len(keep) + 1, (1,), generator=g)), must)
        return keep

    mixed = _decode(everyone, shuffled, steps)
    preempted = _decode(everyone, shuffled, steps, preempt_at=5, preempt="t")
    assert alone["t"] == alone_t["t"] == mixed["t"] == preempted["t"]
    assert alone["tp"] == mixed["tp"] == preempted["tp"]
    # a different seed gives a different stream
    other_seed = target.clone()
    other_seed.seed = 43
    assert _decode({"t": other_seed}, lambda s: ["t"], steps)["t"] != alone["t"]


def test_n_children_with_seed_plus_i_differ_and_repeat():
    row = torch.randn(1, 500)
    kids = []
    for i in range(4):
        p = SamplingParams(temperature=1.5, seed=100 + i)  # the front end's seed + i
        kids.append(p)
    logits = row.expand(4, 500).contiguous()
    a, _ = one_step(kids, logits)
    b, _ = one_step(list(reversed(kids)), logits)
    assert a.sampled_token_ids.tolist() == list(reversed(b.sampled_token_ids.tolist()))
    assert len(set(a.sampled_token_ids.tolist())) > 1


def test_seeded_uniform_is_a_function_of_seed_and_step():
    assert seeded_uniform(5, 3) == seeded_uniform(5, 3)
    values = [seeded_uniform(5, s) for s in range(2000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.03
    assert seeded_uniform(5, 0) != seeded_uniform(6, 0)
    assert seeded_uniform(-1, 0) == seeded_uniform((1 << 64) - 1, 0)


# ----- logprobs --------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(5)
    vocab = 50
    params = [
        SamplingParams(temperature=0, logprobs=3, repetition_penalty=2.0, logit_bias={4: 40.0}),
        SamplingParams(temperature=0.5, top_k=5, logprobs=5, seed=1),
        SamplingParams(temperature=1.0, logprobs=0, seed=2),
        SamplingParams(temperature=1.2, top_p=0.9),  # asks for none
        SamplingParams(temperature=0.7, min_p=0.1, logprobs=1, presence_penalty=2.0, seed=4),
    ]
    logits = torch.randn(len(params), vocab) * 3
    out, meta = one_step(params, logits, prompts=[[4, 5]] * 5, outputs=[[4, 6]] * 5)
    assert meta.max_num_logprobs == 5
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out.top_token_ids.shape == (5, 5) and out.top_logprobs.shape == (5, 5)
    for i in range(len(params)):
        tok = int(out.sampled_token_ids[i])
        assert abs(float(out.logprobs[i]) - float(ref[i, tok])) < 1e-5
        assert int(out.ranks[i]) == 1 + int((ref[i] > ref[i, tok]).sum())
        want_lp, want_ids = torch.sort(ref[i], descending=True)
        assert out.top_token_ids[i].tolist() == want_ids[:5].tolist()
        torch.testing.assert_close(out.top_logprobs[i].double(), want_lp[:5], atol=1e-5, rtol=0)
    assert out.rank is out.ranks
    # the bias made row 0's greedy pick token 4, yet its logprob is the raw one
    assert int(out.sampled_token_ids[0]) == 4


def test_rank_counts_ties_against_the_token():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    out, _ = one_step([SamplingParams(temperature=0, logprobs=2, logit_bias={2: 1.0})], logits)
    assert int(out.sampled_token_ids[0]) == 2
    assert int(out.ranks[0]) == 2  # tied with token 1: both are >= it
    # a token tied with many more tokens than the top entries hold
    logits = torch.zeros(2, 30)
    logits[:, 3] = 5.0
    params = [SamplingParams(temperature=0, logprobs=1, logit_bias={10: 20.0}),
              SamplingParams(temperature=0, logprobs=1, logit_bias={10: 20.0}, allowed_token_ids=[10, 3])]
    out, _ = one_step(params, logits)
    assert out.sampled_token_ids.tolist() == [10, 10]
    assert out.ranks.tolist() == [30, 30]
    assert out.top_token_ids[:, 0].tolist() == [3, 3]


def test_prompt_logprobs_match_reference_and_chunk():
    torch.manual_seed(9)
    n, vocab, k = 37, 80, 4
    logits = torch.randn(n, vocab) * 2
    targets = torch.randint(0, vocab, (n,))
    lp, rank, top_ids, top_lp = compute_prompt_logprobs(logits, targets, k)
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i in range(n):
        t = int(targets[i])
        assert abs(float(lp[i]) - float(ref[i, t])) < 1e-5
        assert int(rank[i]) == 1 + int((ref[i] > ref[i, t]).sum())
        want_lp, want_ids = torch.sort(ref[i], descending=True)
        assert top_ids[i].tolist() == want_ids[:k].tolist()
        torch.testing.assert_close(top_lp[i].double(), want_lp[:k], atol=1e-5, rtol=0)
    parts = [compute_prompt_logprobs(logits[a:a + 10], targets[a:a + 10], k) for a in range(0, n, 10)]
    for j, whole in enumerate((lp, rank, top_ids, top_lp)):
        torch.testing.assert_close(torch.cat([p[j] for p in parts]), whole)
    lp0, _, ids0, tlp0 = compute_prompt_logprobs(logits, targets, 0)
    assert ids0.shape == (n, 0) and tlp0.shape == (n, 0)
    torch.testing.assert_close(lp0, lp)


def test_state_lifecycle():
    state = SamplingState()
    p = SamplingParams(temperature=0.5, seed=1, logprobs=2)
    state.add_request("a", p, [1, 2], [3], frozenset({EOS}))
    assert "a" in state and len(state) == 1
    assert state.num_logprobs("a") == 2 and state.num_output_tokens("a") == 1
    for t in range(40):  # grows past the initial buffer
        state.append_output("a", t)
    assert state.num_output_tokens("a") == 41
    state.remove_request("a")
    state.remove_request("a")
    assert "a" not in state and len(state) == 0
    with pytest.raises(ValueError, match="rows"):
        Sampler(features=HOST)(torch.zeros(2, 5), SamplingState().make_metadata([], "cpu"))
