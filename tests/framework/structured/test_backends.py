"""Both built-in backends (xgrammar, llguidance) against the contract's checks
(framework/testing/structured_checks.py), case by case."""

from __future__ import annotations

import pytest

from portaserve.framework.testing.structured_checks import CASES, INVALID, check_invalid, check_walk

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")


def backend(name: str):
    from portaserve.framework.plugins import get_registry

    return get_registry().get("structured_output_backends", name)


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("case", CASES, ids=[c[0].kind for c in CASES])
def test_backend_walks_valid_outputs(name, case):
    check_walk(backend(name), *case)


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("constraint", INVALID, ids=[c.kind for c in INVALID])
def test_backend_refuses_invalid_constraints(name, constraint):
    check_invalid(backend(name), constraint)


def test_a_compile_past_the_time_limit_fails_only_its_request(monkeypatch):
    """The manager's poll: a compile still running after COMPILE_TIMEOUT_S ends the request."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from portaserve.framework.structured import manager as mgr
    from portaserve.framework.structured.params import StructuredOutputsParams

    m = mgr.StructuredOutputManager(SimpleNamespace(vocab_size=10), "xgrammar")
    request = SimpleNamespace(sampling_params=SimpleNamespace(structured_outputs=StructuredOutputsParams(regex="a")),
                              output_token_ids=[])
    request.grammar = mgr.GrammarState(Future(), submitted=0.0)  # never completes
    monkeypatch.setattr(mgr, "COMPILE_TIMEOUT_S", 5.0)
    assert m.poll(request) and "longer than 5s" in request.grammar.error
    m.shutdown()


def test_a_compiling_request_holds_up_no_other():
    """The scheduler keeps a request whose grammar compiles outside the queue: a request
    behind it runs meanwhile, and it runs once its grammar is ready."""
    from types import SimpleNamespace

    from portaserve.framework.engine.block_manager import BlockManager
    from portaserve.framework.engine.params import SamplingParams
    from portaserve.framework.engine.request import Request
    from portaserve.framework.engine.scheduler import Scheduler
    from portaserve.framework.structured.params import StructuredOutputsParams

    class SlowCompiles:
        ready = False

        def submit(self, request):
            request.grammar = SimpleNamespace(error=None, reasoning_end=())

        def poll(self, request):
            return self.ready

        def bitmask(self, requests, draft_rows=None):
            return tuple(r.request_id for r in requests), b"\xff" * 4 * len(requests), ()

    manager = SlowCompiles()
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=8,
                      block_manager=BlockManager(32, 8, enable_caching=False), structured=manager)
    constrained = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    sched.add_request(Request("slow", [1, 2, 3], sampling_params=constrained, max_tokens=4))
    sched.add_request(Request("plain", [4, 5, 6], sampling_params=SamplingParams(max_tokens=4), max_tokens=4))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["plain"] and out.grammar_req_ids == ()
    manager.ready = True
    out = sched.schedule()
    assert "slow" in out.num_scheduled_tokens and out.grammar_req_ids == ("slow",)


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_proposals_are_cut_where_the_grammar_refuses_them(name):
    """Speculative proposals under a grammar (manager.draft_rows): the longest allowed
    prefix is kept, each position gets the mask row of its state, and the matcher ends
    where it started, even after a refused proposal (llguidance cannot roll back an
    error)."""
    from types import SimpleNamespace

    import torch

    from portaserve.framework.interfaces.structured_output import Constraint
    from portaserve.framework.structured import manager as mgr
    from portaserve.framework.testing.structured_checks import allowed, qwen2_vocab

    vocab, tok = qwen2_vocab()

    def allowed_row(row):
        bits = (row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return set(torch.nonzero(bits.flatten()[:vocab.vocab_size]).flatten().tolist())

    compiled = backend(name)(vocab).compile(Constraint("regex", "(ab|cd)+"))
    m = mgr.StructuredOutputManager(SimpleNamespace(vocab_size=vocab.vocab_size), name)
    matcher = compiled.matcher(mgr.MAX_ROLLBACK_TOKENS)
    request = SimpleNamespace(grammar=SimpleNamespace(matcher=matcher, reasoning_end=()))
    ab, cd, x = (tok.token_to_id(t) for t in ("ab", "cd", "x"))
    start = allowed(matcher)
    assert ab in start and x not in start
    kept, rows = m.draft_rows(request, (ab, cd, x, ab))
    assert kept == (ab, cd) and rows.shape[0] == 3
    reference = compiled.matcher(mgr.MAX_ROLLBACK_TOKENS)
    for j, token in enumerate((ab, cd, None)):
        want = torch.full((1, rows.shape[1]), -1, dtype=torch.int32)
        reference.fill_bitmask(want, 0)
        assert torch.equal(rows[j], want[0]), j
        if token is not None:
            assert reference.accept_token(token)
    assert allowed(matcher) == start and matcher.accept_token(cd)  # back at the start, and usable
    matcher.rollback(1)
    # a stop token ends the grammar: it is not proposed (the verification samples it itself)
    from portaserve.framework.testing.structured_checks import STOP_IDS

    kept, rows = m.draft_rows(request, (ab, STOP_IDS[0], cd))
    assert kept == (ab,) and rows.shape[0] == 2 and STOP_IDS[0] in allowed_row(rows[1]) and allowed(matcher) == start
    kept, rows = m.draft_rows(request, (x, ab))  # the first proposal refused: none kept, position 0's row
    assert kept == () and rows.shape[0] == 1 and allowed(matcher) == start
    # a step's tokens feed the grammar up to the one that ends the request (EOS here)
    request.sampling_params = SimpleNamespace(stop_token_ids=[], ignore_eos=False)
    request.eos_token_ids = {STOP_IDS[0]}
    assert m.accept_all(request, (ab, STOP_IDS[0], x)) is None and matcher.is_terminated()
    m.shutdown()
