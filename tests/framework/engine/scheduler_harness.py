"""The scheduler tests' harness: Scheduler + BlockManager driven by a fake model runner.

The fake runner keeps a fake paged KV cache: every computed position writes
(position, hash of the whole token prefix) into its slot, and every step reads back all
positions of every scheduled request through its block table, as attention would, and
checks them. A shared, evicted or mis-mapped block therefore shows up as a wrong read.
The next token is a pure function of the token history, so the reference output of a
request is computable without any scheduler (`reference`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from portaserve.framework.engine.block_manager import BlockManager
from portaserve.framework.engine.params import SamplingParams
from portaserve.framework.engine.request import Request
from portaserve.framework.engine.scheduler import Scheduler
from portaserve.framework.engine.scheduler_output import Logprobs, ModelRunnerOutput, SchedulerOutput

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
