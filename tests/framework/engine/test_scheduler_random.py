"""Randomized add / abort / step sequences against the scheduler's invariants, and
siblings that cannot fit (harness: scheduler_harness.py)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_harness import (  # tests/framework/engine/ is on sys.path: its conftest
    V,
    Result,
    drain,
    make,
    new_req,
    reference,
    step,
)

from portaserve.framework.errors import InvalidParameterError


# ----- randomized property test ------------------------------------------------------------

BASES = [[7, 3, 9, 1, 4, 4, 2, 8], [5, 5, 5, 5, 6, 6, 6, 6], [11, 12, 13, 14, 15, 16, 17, 18]]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.lists(st.integers(1, V - 1), max_size=10), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(8, 24),
    block_size=st.sampled_from([2, 4]),
    budget=st.integers(4, 24),
    max_num_seqs=st.integers(1, 6),
    policy=st.sampled_from(["fcfs", "priority"]),
    chunked=st.booleans(),
    caching=st.booleans(),
    prefill_cap=st.sampled_from([None, 1, 3]),
)
def test_random_add_abort_step(ops, num_blocks, block_size, budget, max_num_seqs, policy, chunked, caching, prefill_cap):
    sched, runner = make(
        num_blocks, block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, chunked=chunked, policy=policy,
        caching=caching, prefill_cap=prefill_cap,
    )
    res: dict[str, Result] = {}
    added: dict[str, tuple[list[int], int]] = {}
    aborted: set[str] = set()
    for op in ops:
        if op[0] == "add":
            _, base, tail, max_tokens, prio = op
            prompt = BASES[base][: 2 + len(tail) % 7] + tail
            rid = f"r{len(added)}"
            try:
                sched.add_request(new_req(rid, prompt, max_tokens=max_tokens, priority=prio))
            except InvalidParameterError:
                assert len(prompt) + max_tokens > (num_blocks - 1) * block_size or (not chunked and len(prompt) > budget)
                continue
            added[rid] = (prompt, max_tokens)
        elif op[0] == "abort":
            if added:
                rid = f"r{op[1] % len(added)}"
                if rid in sched.requests:
                    aborted.add(rid)
                sched.abort_requests([rid])
        else:
            for _ in range(op[1]):
                step(sched, runner, res)
    drain(sched, runner, res)
    for rid, (prompt, max_tokens) in added.items():
        assert res[rid].finish_reason is not None, f"{rid} never finished"
        if rid in aborted:
            assert res[rid].finish_reason == "abort"
            assert res[rid].tokens == reference(prompt, max_tokens)[: len(res[rid].tokens)]
        else:
            assert res[rid].tokens == reference(prompt, max_tokens)


@pytest.mark.parametrize("caching", [True, False])
def test_siblings_that_cannot_fit_together_are_refused_up_front(caching):
    # 16 usable blocks of 4 tokens; a 12-token prompt (3 full blocks) + 8 new tokens = 5 blocks per sequence
    sched, _ = make(num_blocks=17, block_size=4, caching=caching)
    siblings = [new_req(f"r-{i}", list(range(1, 13)), max_tokens=8) for i in range(4)]
    if caching:  # 3 shared prompt blocks + 4 x 2 own blocks = 11 <= 16
        sched.check_siblings_fit(siblings)
    else:  # 4 x 5 = 20 > 16
        with pytest.raises(InvalidParameterError, match="need 20 KV blocks together") as err:
            sched.check_siblings_fit(siblings)
        assert err.value.param == "n"
    many = [new_req(f"m-{i}", list(range(1, 13)), max_tokens=8) for i in range(7)]
    with pytest.raises(InvalidParameterError, match="n: 7 sequences"):
        sched.check_siblings_fit(many)  # 3 + 7 x 2 = 17 > 16 even when the prompt is shared
    sched.check_siblings_fit(many[:1])  # one sequence: the per-request check decides
