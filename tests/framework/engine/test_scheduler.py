"""The scheduler against the reference outputs, and its batching and priority rules
(harness: scheduler_harness.py)."""

from __future__ import annotations

import pytest
from scheduler_harness import (  # tests/framework/engine/ is on sys.path: its conftest
    EOS,
    Result,
    drain,
    make,
    new_req,
    prompts_mixed,
    reference,
    step,
)

from portaserve.framework.errors import InvalidParameterError


# ----- correctness against the reference --------------------------------------------


def test_mixed_batch_matches_reference():
    sched, runner = make()
    prompts = prompts_mixed(10)
    for i, p in enumerate(prompts):
        sched.add_request(new_req(f"r{i}", p, max_tokens=12))
    res = drain(sched, runner)
    for i, p in enumerate(prompts):
        assert res[f"r{i}"].tokens == reference(p, 12)
        assert res[f"r{i}"].finish_reason == ("stop" if res[f"r{i}"].tokens[-1] == EOS else "length")
    assert sched.stats().num_preemptions == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("caching", [True, False])
def test_tiny_kv_budget_preempts_and_matches_ample_run(policy, chunked, caching):
    prompts = prompts_mixed(12, seed=1, lo=4, hi=16)
    prompts += [prompts[0][:8] + [5, 6], prompts[0][:8] + [7]]  # shared prefixes
    outs = {}
    for num_blocks in (200, 12):
        sched, runner = make(num_blocks, 4, max_num_batched_tokens=20, policy=policy, chunked=chunked, caching=caching)
        for i, p in enumerate(prompts):
            sched.add_request(new_req(f"r{i}", p, max_tokens=24, priority=i % 3, ignore_eos=True))
        outs[num_blocks] = drain(sched, runner)
        if num_blocks == 12:
            assert sched.stats().num_preemptions > 0
    for i, p in enumerate(prompts):
        assert outs[12][f"r{i}"].tokens == outs[200][f"r{i}"].tokens == reference(p, 24, ignore_eos=True)


def test_preempted_request_resumes_with_its_outputs():
    sched, runner = make(7, 4, max_num_seqs=2, max_num_batched_tokens=16)  # 6 usable blocks = 24 tokens
    a, b = new_req("a", range(1, 9), max_tokens=14, ignore_eos=True), new_req("b", range(11, 19), max_tokens=14, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    res: dict[str, Result] = {}
    resumed = None
    while sched.has_unfinished_requests() and resumed is None:
        before = list(res["b"].tokens) if "b" in res else []
        so = step(sched, runner, res)
        resumed = next((n for n in so.new_requests if n.output_token_ids), None)
    assert resumed is not None and resumed.req_id == "b"  # FCFS preempts the last admitted
    assert list(resumed.output_token_ids) == before and resumed.num_computed_tokens == 0
    assert b.num_preemptions == 1
    drain(sched, runner, res)
    assert res["a"].tokens == reference(range(1, 9), 14, ignore_eos=True)
    assert res["b"].tokens == reference(range(11, 19), 14, ignore_eos=True)


# ----- batching rules --------------------------------------------------------------


def test_chunked_prefill_splits_long_prompt_while_decodes_run():
    sched, runner = make(max_num_batched_tokens=8)
    res: dict[str, Result] = {}
    for rid in ("d1", "d2"):
        sched.add_request(new_req(rid, [3, 4, 5], max_tokens=30, ignore_eos=True))
    step(sched, runner, res)
    long_prompt = list(range(1, 41))
    sched.add_request(new_req("long", long_prompt, max_tokens=4, ignore_eos=True))
    chunks = []
    while not res.get("long") or not res["long"].tokens:
        so = step(sched, runner, res)
        assert so.num_scheduled_tokens["d1"] == so.num_scheduled_tokens["d2"] == 1  # decodes keep running
        chunks.append(so.num_scheduled_tokens["long"])
    assert chunks == [6] * 6 + [4]
    res = drain(sched, runner, res)
    assert res["long"].tokens == reference(long_prompt, 4, ignore_eos=True)
    assert res["d1"].tokens == reference([3, 4, 5], 30, ignore_eos=True)


def test_prefill_cap_while_decoding_bounds_prompt_tokens_per_step():
    """max_prefill_tokens_with_decodes: a step with a decode in it takes at most the cap
    of prompt tokens (running chunks and new prompts together); a step with no decode
    takes the whole budget; outputs stay the reference."""
    sched, runner = make(max_num_batched_tokens=32, prefill_cap=6)
    results: dict[str, Result] = {}
    first = prompts_mixed(2, seed=3, lo=8, hi=12)
    later = prompts_mixed(4, seed=4, lo=10, hi=20)
    for i, p in enumerate(first):
        sched.add_request(new_req(f"a{i}", p, max_tokens=12, ignore_eos=True))
    so = step(sched, runner, results)
    assert so.total_num_scheduled_tokens == sum(len(p) for p in first)  # nothing decoding yet: full budget
    for i, p in enumerate(later):
        sched.add_request(new_req(f"b{i}", p, max_tokens=6, ignore_eos=True))
    saw_capped_step = False
    while sched.has_unfinished_requests():
        so = step(sched, runner, results)
        lens = {r.request_id: len(r.prompt_token_ids) + len(r.output_token_ids) for r in sched.running}
        decodes = [rid for rid, n in so.num_scheduled_tokens.items() if n == 1]
        prefill = sum(n for n in so.num_scheduled_tokens.values() if n > 1)
        if decodes:
            assert prefill <= 6, so.num_scheduled_tokens
            saw_capped_step |= prefill == 6
        assert all(n <= lens.get(rid, n) for rid, n in so.num_scheduled_tokens.items())
    assert saw_capped_step
    for i, p in enumerate(first):
        assert results[f"a{i}"].tokens == reference(p, 12, ignore_eos=True)
    for i, p in enumerate(later):
        assert results[f"b{i}"].tokens == reference(p, 6, ignore_eos=True)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks
    with pytest.raises(InvalidParameterError, match="max_prefill_tokens_with_decodes"):
        make(prefill_cap=0)


def test_without_chunked_prefill_a_prompt_waits_for_the_budget():
    sched, runner = make(max_num_batched_tokens=10, chunked=False)
    res: dict[str, Result] = {}
    sched.add_request(new_req("d1", [1, 2, 3], max_tokens=5, ignore_eos=True))
    sched.add_request(new_req("d2", [4, 5], max_tokens=5, ignore_eos=True))
    step(sched, runner, res)
    sched.add_request(new_req("big", range(1, 10), max_tokens=3, ignore_eos=True))  # 9 > 10 - 2
    waited = 0
    while True:
        so = step(sched, runner, res)
        if "big" in so.num_scheduled_tokens:
            assert so.num_scheduled_tokens["big"] == 9  # never split
            break
        waited += 1
    assert waited == 4  # until both decodes finished (5 tokens each, one came from the first step)
    res = drain(sched, runner, res)
    assert res["big"].tokens == reference(range(1, 10), 3, ignore_eos=True)


def test_max_num_seqs_and_budget_respected():
    sched, runner = make(max_num_seqs=3, max_num_batched_tokens=7)
    prompts = prompts_mixed(9, seed=3)
    for i, p in enumerate(prompts):
        sched.add_request(new_req(f"r{i}", p, max_tokens=6))
    res = drain(sched, runner)  # `step` checks both limits every step
    assert max(len(b.num_scheduled_tokens) for b in runner.batches) == 3
    for i, p in enumerate(prompts):
        assert res[f"r{i}"].tokens == reference(p, 6)


def test_priority_admission_order():
    sched, runner = make(max_num_seqs=1, policy="priority")
    for rid, prio, arrival in (("c", 3, 1.0), ("a", 1, 3.0), ("b2", 2, 2.5), ("b1", 2, 2.0)):
        sched.add_request(new_req(rid, [7, 8, 9], max_tokens=2, ignore_eos=True, priority=prio, arrival=arrival))
    drain(sched, runner)
    order = [so.new_requests[0].req_id for so in runner.batches if so.new_requests]
    assert order == ["a", "b1", "b2", "c"]


def test_fcfs_ignores_priority_and_never_preempts_for_arrivals():
    sched, runner = make(max_num_seqs=1)
    sched.add_request(new_req("low", [1, 2], max_tokens=4, ignore_eos=True, priority=5))
    res: dict[str, Result] = {}
    step(sched, runner, res)
    sched.add_request(new_req("high", [3, 4], max_tokens=4, ignore_eos=True, priority=0))
    drain(sched, runner, res)
    order = [so.new_requests[0].req_id for so in runner.batches if so.new_requests]
    assert order == ["low", "high"] and sched.stats().num_preemptions == 0


def test_priority_preempts_for_a_sequence_slot():
    sched, runner = make(max_num_seqs=1, policy="priority")
    res: dict[str, Result] = {}
    sched.add_request(new_req("low", [1, 2, 3], max_tokens=6, ignore_eos=True, priority=5))
    step(sched, runner, res)
    step(sched, runner, res)
    sched.add_request(new_req("high", [4, 5, 6], max_tokens=3, ignore_eos=True, priority=0))
    so = step(sched, runner, res)
    assert list(so.num_scheduled_tokens) == ["high"] and "low" in so.finished_req_ids
    drain(sched, runner, res)
    assert sched.stats().num_preemptions == 1
    assert res["low"].tokens == reference([1, 2, 3], 6, ignore_eos=True)
    assert res["high"].tokens == reference([4, 5, 6], 3, ignore_eos=True)


def test_priority_preempts_for_blocks_even_when_victim_was_scheduled_this_step():
    # 6 usable blocks of 4. "low" holds 4 blocks (16 tokens); "high" needs 3.
    sched, runner = make(7, 4, max_num_seqs=4, max_num_batched_tokens=32, policy="priority")
    res: dict[str, Result] = {}
    sched.add_request(new_req("low", range(1, 14), max_tokens=10, ignore_eos=True, priority=9))
    step(sched, runner, res)
    step(sched, runner, res)
    step(sched, runner, res)  # low: 16 tokens, 4 blocks
    assert sched.block_manager.num_free_blocks == 2
    sched.add_request(new_req("high", range(20, 30), max_tokens=3, ignore_eos=True, priority=0))
    so = step(sched, runner, res)
    # low was scheduled for a decode in the running pass, then taken out for high
    assert list(so.num_scheduled_tokens) == ["high"] and "low" in so.finished_req_ids
    drain(sched, runner, res)
    assert res["low"].tokens == reference(range(1, 14), 10, ignore_eos=True)
    assert res["high"].tokens == reference(range(20, 30), 3, ignore_eos=True)


def test_victim_taken_out_of_its_step_does_not_leave_unwritten_blocks_cached():
    # 7 usable blocks of 4, budget 16. "v" prefills 24 tokens: 16, then 8 — blocks 4 and
    # 5 are hashed when allocated — and is taken out of that second step for "w", which
    # needs 2 blocks with 1 free. Were blocks 4 and 5 left cached, w would evict only
    # one of them and v would later "hit" the other, never written.
    sched, runner = make(8, 4, max_num_batched_tokens=16, policy="priority")
    res: dict[str, Result] = {}
    v_prompt = list(range(1, 25))
    sched.add_request(new_req("v", v_prompt, max_tokens=4, ignore_eos=True, priority=9))
    step(sched, runner, res)
    sched.add_request(new_req("w", range(30, 38), max_tokens=1, ignore_eos=True, priority=0))
    so = step(sched, runner, res)
    assert list(so.num_scheduled_tokens) == ["w"] and "v" in so.finished_req_ids
    drain(sched, runner, res)
    assert res["v"].tokens == reference(v_prompt, 4, ignore_eos=True)
    assert res["w"].tokens == reference(range(30, 38), 1, ignore_eos=True)


def test_victim_whose_fresh_blocks_were_hit_this_step_is_not_taken_out():
    sched, runner = make(8, 4, max_num_batched_tokens=16, policy="priority")
    res: dict[str, Result] = {}
    v_prompt = list(range(1, 25))
    sched.add_request(new_req("v", v_prompt, max_tokens=4, ignore_eos=True, priority=9))
    step(sched, runner, res)
    sched.add_request(new_req("s", v_prompt + [1], max_tokens=2, ignore_eos=True, priority=0))
    sched.add_request(new_req("w", range(30, 38), max_tokens=2, ignore_eos=True, priority=0))
    so = step(sched, runner, res)
    # s hit v's blocks 4 and 5, which v writes in this very step: v must stay in it.
    assert so.num_scheduled_tokens == {"v": 8, "s": 1}
    drain(sched, runner, res)
    assert res["s"].num_cached_tokens == 24
    for rid, prompt, n in (("v", v_prompt, 4), ("s", v_prompt + [1], 2), ("w", list(range(30, 38)), 2)):
        assert res[rid].tokens == reference(prompt, n, ignore_eos=True)
