"""Scheduler + BlockManager driven by a fake model runner.

The fake runner keeps a fake paged KV cache: every computed position writes
(position, hash of the whole token prefix) into its slot, and every step reads back all
positions of every scheduled request through its block table, as attention would, and
checks them. A shared, evicted or mis-mapped block therefore shows up as a wrong read.
The next token is a pure function of the token history, so the reference output of a
request is computable without any scheduler (`reference`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portaserve.framework.engine.block_manager import BlockManager
from portaserve.framework.engine.params import PoolingParams, SamplingParams
from portaserve.framework.engine.request import Request, RequestStatus
from portaserve.framework.engine.scheduler import Scheduler
from portaserve.framework.engine.scheduler_output import Logprobs, ModelRunnerOutput, SchedulerOutput
from portaserve.framework.errors import InvalidParameterError

V = 61  # vocabulary of the fake model
EOS = 0
MASK = (1 << 61) - 1
H0 = 0x1234567


def roll(h: int, token: int) -> int:
    return (h * 1000003 + token + 1) & MASK


def next_token(prefix_hash: int) -> int:
    return prefix_hash % V


def reference(prompt, max_tokens, *, ignore_eos=False, max_model_len=10**9) -> list[int]:
    """What an ideal engine generates for `prompt` with the fake model (greedy)."""
    h = H0
    for t in prompt:
        h = roll(h, t)
    out: list[int] = []
    while True:
        t = next_token(h)
        out.append(t)
        h = roll(h, t)
        if t == EOS and not ignore_eos:
            return out
        if len(out) >= max_tokens or len(prompt) + len(out) >= max_model_len:
            return out


@dataclass
class _State:
    tokens: list[int]
    num_prompt: int
    blocks: list[int]
    num_computed: int
    pooling: bool
    prompt_logprobs: int | None
    hashes: list[int] = field(default_factory=list)


class FakeRunner:
    """Follows the model runner's protocol (its own token copy, deltas for cached requests)."""

    def __init__(self, block_size: int, null_block: int | None = 0, choose=None) -> None:
        self.bs = block_size
        self.null_block = null_block
        self.kv: dict[int, tuple[int, int]] = {}
        self.states: dict[str, _State] = {}
        self.choose = choose  # (req_id, state) -> token, to script outputs
        self.batches: list[SchedulerOutput] = []

    def _prefix_hash(self, s: _State, i: int) -> int:
        while len(s.hashes) <= i:
            prev = s.hashes[-1] if s.hashes else H0
            s.hashes.append(roll(prev, s.tokens[len(s.hashes)]))
        return s.hashes[i]

    def _slot(self, s: _State, pos: int) -> int:
        block = s.blocks[pos // self.bs]
        assert block != self.null_block, "a request was given the null block"
        return block * self.bs + pos % self.bs

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.batches.append(so)
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        for new in so.new_requests:
            assert new.req_id not in self.states, f"{new.req_id} sent as new while the runner still has it"
            sp = new.sampling_params
            self.states[new.req_id] = _State(
                tokens=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt=len(new.prompt_token_ids),
                blocks=list(new.block_ids),
                num_computed=new.num_computed_tokens,
                pooling=new.pooling_params is not None,
                prompt_logprobs=sp.prompt_logprobs if sp is not None else None,
            )
        for c in so.cached_requests:
            s = self.states[c.req_id]
            assert s.num_computed == c.num_computed_tokens, f"{c.req_id}: scheduler and runner disagree"
            s.blocks.extend(c.new_block_ids)
        ids = so.req_ids()
        assert sorted(ids) == sorted(so.num_scheduled_tokens)
        written: set[int] = set()
        for rid in ids:  # write every new K/V of the batch first, like attention backends
            s, n = self.states[rid], so.num_scheduled_tokens[rid]
            assert n >= 1 and s.num_computed + n <= len(s.tokens)
            assert len(s.blocks) * self.bs >= s.num_computed + n, f"{rid}: too few blocks"
            for pos in range(s.num_computed, s.num_computed + n):
                slot = self._slot(s, pos)
                assert slot not in written, f"slot {slot} written twice in one step"
                written.add(slot)
                self.kv[slot] = (pos, self._prefix_hash(s, pos))
        sampled: dict[str, int] = {}
        prompt_lps: dict[str, tuple[Logprobs, ...]] = {}
        pooled: dict[str, tuple[float, ...]] = {}
        for rid in ids:  # then read, as attention does
            s, n = self.states[rid], so.num_scheduled_tokens[rid]
            start, end = s.num_computed, s.num_computed + n
            for pos in range(end):
                assert self.kv.get(self._slot(s, pos)) == (pos, self._prefix_hash(s, pos)), f"{rid}: wrong K/V at position {pos}"
            s.num_computed = end
            if s.prompt_logprobs is not None:
                last = min(end, s.num_prompt - 1)
                if last > start:
                    prompt_lps[rid] = tuple(Logprobs(s.tokens[p + 1], -float(p), 1, (), ()) for p in range(start, last))
            if end == len(s.tokens):
                if s.pooling:
                    pooled[rid] = (float(self._prefix_hash(s, end - 1) % 1000),)
                else:
                    t = self.choose(rid, s) if self.choose else next_token(self._prefix_hash(s, end - 1))
                    s.tokens.append(t)
                    sampled[rid] = t
        return ModelRunnerOutput(sampled_token_ids=sampled, prompt_logprobs=prompt_lps, pooler_output=pooled)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None
    num_prompt_logprob_outputs: int = 0
    pooler_output: tuple | None = None
    num_cached_tokens: int = 0


def make(num_blocks=64, block_size=4, *, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, chunked=True,
         policy="fcfs", caching=True, choose=None, prefill_cap=None):
    bm = BlockManager(num_blocks, block_size, enable_caching=caching)
    sched = Scheduler(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
        block_manager=bm,
        enable_chunked_prefill=chunked,
        scheduling_policy=policy,
        max_prefill_tokens_with_decodes=prefill_cap,
    )
    return sched, FakeRunner(block_size, choose=choose)


def new_req(rid, prompt, max_tokens=8, *, priority=0, arrival=None, salt=None, **sp) -> Request:
    kwargs = {} if arrival is None else {"arrival_time": arrival}
    return Request(
        rid,
        list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, **sp),
        eos_token_ids=frozenset({EOS}),
        priority=priority,
        cache_salt=salt,
        max_tokens=max_tokens,
        **kwargs,
    )


def step(sched: Scheduler, runner: FakeRunner, results: dict[str, Result]) -> SchedulerOutput:
    preemptions_before = sched.num_preemptions
    so = sched.schedule()
    if sched.policy == "fcfs" and sched.num_preemptions > preemptions_before:
        assert not so.new_requests, "a step that preempted must not admit waiting requests"
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= sched.max_num_seqs and len(sched.running) <= sched.max_num_seqs
    if so.is_empty:
        assert sched.get_num_unfinished_requests() == 0, "the scheduler stalled with unfinished requests"
    out = sched.update_from_output(so, None if so.is_empty else runner.execute(so))
    for o in out:
        r = results.setdefault(o.req_id, Result())
        assert r.finish_reason is None, f"{o.req_id} reported after it finished"
        r.tokens.extend(o.new_token_ids)
        r.finish_reason = o.finish_reason
        r.stop_reason = o.stop_reason
        r.num_cached_tokens = o.num_cached_tokens
        if o.prompt_logprobs is not None:
            r.prompt_logprobs = list(o.prompt_logprobs)
            r.num_prompt_logprob_outputs += 1
        if o.pooler_output is not None:
            r.pooler_output = o.pooler_output
    assert sched.block_manager.consistency_errors() == []
    return so


def drain(sched, runner, results=None, max_steps=5000) -> dict[str, Result]:
    results = {} if results is None else results
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner, results)
    assert not sched.has_unfinished_requests(), "requests did not finish"
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks, "blocks leaked"
    return results


def prompts_mixed(n, seed=0, lo=3, hi=30):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, V) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


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


# ----- prefix caching through the scheduler -------------------------------------------


def test_n_siblings_share_the_prompt_in_the_same_step():
    sched, runner = make()
    prompt = list(range(1, 19))  # 4 full blocks + 2
    for i in range(4):
        sched.add_request(new_req(f"p-{i}", prompt, max_tokens=5, ignore_eos=True))
    res: dict[str, Result] = {}
    so = step(sched, runner, res)
    assert so.num_scheduled_tokens == {"p-0": 18, "p-1": 2, "p-2": 2, "p-3": 2}
    res = drain(sched, runner, res)
    stats = sched.stats()
    assert stats.prefix_cache_hits == 3 * 16 and stats.prefix_cache_queries == 4 * 18
    for i in range(4):
        assert res[f"p-{i}"].tokens == reference(prompt, 5, ignore_eos=True)
        assert res[f"p-{i}"].num_cached_tokens == (0 if i == 0 else 16)


def test_finished_request_prefix_served_later():
    sched, runner = make()
    drain_one = lambda rid, p: (sched.add_request(new_req(rid, p, max_tokens=3, ignore_eos=True)), drain(sched, runner))[1]
    drain_one("a", list(range(1, 23)))
    res = drain_one("b", list(range(1, 21)) + [9, 9, 9])
    assert res["b"].num_cached_tokens == 20 and sched.stats().prefix_cache_hits == 20
    assert res["b"].tokens == reference(list(range(1, 21)) + [9, 9, 9], 3, ignore_eos=True)
    assert sched.reset_prefix_cache() is True
    res = drain_one("c", list(range(1, 23)))
    assert res["c"].num_cached_tokens == 0


def test_reset_prefix_cache_refused_while_running():
    sched, runner = make()
    sched.add_request(new_req("a", range(1, 10), max_tokens=3))
    step(sched, runner, {})
    assert sched.reset_prefix_cache() is False


# ----- stop rules -------------------------------------------------------------------


def scripted(tokens_by_req: dict[str, list[int]]):
    return lambda rid, s: tokens_by_req[rid][len(s.tokens) - s.num_prompt]


def run_scripted(script, reqs, **kw):
    sched, runner = make(choose=scripted(script), **kw)
    for r in reqs:
        sched.add_request(r)
    return drain(sched, runner)


def test_stop_rules():
    script = {
        "eos": [5, 6, EOS, 7, 8],
        "ignore": [5, EOS, 6, EOS, 7],
        "stop_tok": [5, 42, 6, 7],
        "min_tok": [EOS, 42, 5, EOS, 6, 7],
        "length": [1, 2, 3, 4, 5, 6],
        "model_len": [1, 2, 3, 4, 5, 6],
    }
    reqs = [
        new_req("eos", [1, 2], max_tokens=5),
        new_req("ignore", [1, 2], max_tokens=4, ignore_eos=True),
        new_req("stop_tok", [1, 2], max_tokens=4, stop_token_ids=[42]),
        new_req("min_tok", [1, 2], max_tokens=6, min_tokens=3, stop_token_ids=[42]),
        new_req("length", [1, 2], max_tokens=3),
        new_req("model_len", list(range(1, 13)), max_tokens=4),
    ]
    res = run_scripted(script, reqs, max_model_len=14)
    assert (res["eos"].tokens, res["eos"].finish_reason, res["eos"].stop_reason) == ([5, 6, EOS], "stop", None)
    assert (res["ignore"].tokens, res["ignore"].finish_reason) == ([5, EOS, 6, EOS], "length")
    assert (res["stop_tok"].tokens, res["stop_tok"].finish_reason, res["stop_tok"].stop_reason) == ([5, 42], "stop", 42)
    assert (res["min_tok"].tokens, res["min_tok"].finish_reason) == ([EOS, 42, 5, EOS], "stop")
    assert (res["length"].tokens, res["length"].finish_reason) == ([1, 2, 3], "length")
    assert (res["model_len"].tokens, res["model_len"].finish_reason) == ([1, 2], "length")


def test_eos_wins_over_length_on_the_last_token():
    res = run_scripted({"a": [4, EOS]}, [new_req("a", [1], max_tokens=2)])
    assert res["a"].finish_reason == "stop"


# ----- abort, finish, add-time errors -----------------------------------------------------


def test_abort_anywhere_frees_everything():
    sched, runner = make(10, 4, max_num_seqs=2, max_num_batched_tokens=12)
    res: dict[str, Result] = {}
    for i, p in enumerate(prompts_mixed(5, seed=7, lo=6, hi=12)):
        sched.add_request(new_req(f"r{i}", p, max_tokens=20, ignore_eos=True))
    for _ in range(6):
        step(sched, runner, res)
    statuses = {r.request_id: r.status for r in sched.requests.values()}
    assert RequestStatus.RUNNING in statuses.values() and RequestStatus.WAITING in statuses.values()
    sched.abort_requests(["r0", "r4", "nope"])
    so = step(sched, runner, res)
    assert {"r0", "r4"} <= so.finished_req_ids and not {"r0", "r4"} & set(so.num_scheduled_tokens)
    assert res["r0"].finish_reason == res["r4"].finish_reason == "abort"
    sched.abort_requests(list(sched.requests))
    assert sched.get_num_unfinished_requests() == 0 and sched.has_unfinished_requests()
    so = sched.schedule()
    assert so.is_empty
    outs = sched.update_from_output(so, None)
    assert {o.req_id for o in outs} == {"r1", "r2", "r3"} and all(o.finish_reason == "abort" for o in outs)
    assert not sched.has_unfinished_requests()
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks and bm.consistency_errors() == []
    # The empty step's finish notices reach the runner with the next real step.
    sched.add_request(new_req("x", [1, 2], max_tokens=1))
    so = sched.schedule()
    assert {"r1", "r2", "r3"} <= so.finished_req_ids


def test_finish_requests_from_the_front_end():
    sched, runner = make()
    res: dict[str, Result] = {}
    sched.add_request(new_req("a", [1, 2, 3], max_tokens=10))
    step(sched, runner, res)
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert not sched.has_unfinished_requests()
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks
    with pytest.raises(ValueError):
        sched.finish_requests(["a"], RequestStatus.RUNNING)


def test_add_request_rejects_what_can_never_run():
    sched, _ = make(5, 4, max_model_len=64, max_num_batched_tokens=8, chunked=False)  # 16 tokens of KV
    with pytest.raises(InvalidParameterError, match="max_tokens") as e:
        sched.add_request(new_req("a", range(1, 8), max_tokens=10))
    assert "16" in str(e.value)
    with pytest.raises(InvalidParameterError, match="prompt"):
        sched.add_request(new_req("b", range(1, 20), max_tokens=1))
    with pytest.raises(InvalidParameterError, match="max_num_batched_tokens"):
        sched.add_request(new_req("c", range(1, 10), max_tokens=2))
    with pytest.raises(InvalidParameterError, match="prompt"):
        sched.add_request(new_req("d", [], max_tokens=2))
    sched2, _ = make(max_model_len=16)
    with pytest.raises(InvalidParameterError, match="max_model_len"):
        sched2.add_request(new_req("e", range(16), max_tokens=1))
    sched2.add_request(new_req("f", [1], max_tokens=1))
    with pytest.raises(InvalidParameterError, match="request_id"):
        sched2.add_request(new_req("f", [1], max_tokens=1))


# ----- prompt logprobs, pooling --------------------------------------------------------


def test_prompt_logprobs_sent_once_whole_across_chunks_and_preemption():
    sched, runner = make(9, 4, max_num_batched_tokens=5, max_num_seqs=3)
    prompt = list(range(1, 14))
    sched.add_request(new_req("lp", prompt, max_tokens=12, ignore_eos=True, prompt_logprobs=1))
    sched.add_request(new_req("other", prompt, max_tokens=12, ignore_eos=True))
    sched.add_request(new_req("third", range(30, 40), max_tokens=12, ignore_eos=True))
    res = drain(sched, runner)
    assert sched.stats().num_preemptions > 0
    r = res["lp"]
    assert r.num_prompt_logprob_outputs == 1
    assert [lp.token_id for lp in r.prompt_logprobs] == prompt[1:]
    assert r.num_cached_tokens == 0  # prompt-logprob requests never read the cache
    assert r.tokens == reference(prompt, 12, ignore_eos=True)


def test_pooling_request_is_never_chunked_and_finishes_with_its_output():
    sched, runner = make(max_num_batched_tokens=16)  # chunked prefill on
    sched.add_request(Request("emb", list(range(1, 15)), pooling_params=PoolingParams()))
    sched.add_request(new_req("gen", range(1, 12), max_tokens=3, ignore_eos=True))
    res = drain(sched, runner)
    assert res["emb"].finish_reason == "stop" and res["emb"].tokens == []
    assert res["emb"].pooler_output is not None
    first = next(b for b in runner.batches if "emb" in b.num_scheduled_tokens)
    assert first.num_scheduled_tokens["emb"] == 14
    with pytest.raises(InvalidParameterError, match="max_num_batched_tokens"):
        sched.add_request(Request("emb2", list(range(1, 20)), pooling_params=PoolingParams()))


def test_stats_snapshot():
    sched, runner = make(17, 4)
    sched.add_request(new_req("a", range(1, 10), max_tokens=4))
    sched.add_request(new_req("b", range(1, 10), max_tokens=4))
    s0 = sched.stats()
    assert (s0.num_running, s0.num_waiting, s0.kv_cache_usage) == (0, 2, 0.0)
    step(sched, runner, {})
    s1 = sched.stats()
    assert s1.num_running == 2 and s1.num_waiting == 0 and 0 < s1.kv_cache_usage < 1
    assert s1.num_total_blocks == 16 and s1.num_steps == 1
    with pytest.raises(Exception):
        s1.num_running = 3  # frozen


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
