"""The scheduler's prefix caching, stop rules, aborts, add-time errors, prompt logprobs,
pooling and stats (harness: scheduler_harness.py)."""

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

from portaserve.framework.engine.params import PoolingParams
from portaserve.framework.engine.request import Request, RequestStatus
from portaserve.framework.errors import InvalidParameterError


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
