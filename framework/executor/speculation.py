"""Speculative decoding, the runner's side: verifying a step's proposals.

The scheduler scheduled each request's last token followed by its proposals
d1..dk, so one forward pass gave logits at every position. Position j is sampled exactly
as decoding without speculation would sample it, with the request's full sampling
state (parameters, penalties over the output so far, min_tokens, logits processors, the
seeded draw of output position n + j), through the same sampler; the token is kept, and
the request goes on to position j + 1 only when it equals d(j+1). So:

- greedy and seeded requests produce exactly the tokens they would without speculation;
- unseeded requests draw each position from the target distribution: for a proposal
  that is a single token d (n-gram lookup), rejection sampling accepts d with
  probability p(d) and otherwise draws from p without d; drawing x ~ p and keeping it
  (accepting d when x = d) is the same distribution with one uniform per position.

Each round samples the requests still accepting; a step costs at most k + 1 sampler
calls instead of one, over the few rows that remain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from portaserve.framework.engine.scheduler_output import Logprobs, ModelRunnerOutput
from portaserve.framework.executor.input_batch import HostInputs, RequestState, build_inputs


def decode_rows(states: Sequence[RequestState], counts: Sequence[int], drafts: Mapping[str, tuple[int, ...]],
                block_size: int, with_kv_cache: bool) -> HostInputs:
    """The step's inputs with each request's last token and proposals split into one-token
    queries over the same block table (positions n - 1 .. n - 1 + k, each attending up to
    itself), so attention computes every row as a decode of that position would: the
    rows' numbers do not depend on speculation. The rows keep their order; the returned
    `query_start_loc` is per request, as the runner expects."""
    rows: list[RequestState] = []
    row_counts: list[int] = []
    for state, count in zip(states, counts):
        k = len(drafts.get(state.req_id, ()))
        if not k:
            rows.append(state)
            row_counts.append(count)
            continue
        first = state.num_computed_tokens
        rows += [dataclasses.replace(state, num_computed_tokens=first + j) for j in range(k + 1)]
        row_counts += [1] * (k + 1)
    host = build_inputs(rows, row_counts, block_size, with_kv_cache=with_kv_cache)
    query_start_loc = np.zeros(len(states) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    return dataclasses.replace(host, query_start_loc=query_start_loc)


def verify(runner: Any, inputs: Any, hidden: torch.Tensor, prompt_logprobs: dict,
           drafts: Mapping[str, tuple[int, ...]]) -> ModelRunnerOutput:
    """Sample every request of the step that reached the end of its known tokens (the
    runner's only sampling path: without proposals, one token each), the requests with
    proposals position after position (see the module docstring)."""
    states = inputs.states
    qsl = inputs.query_start_loc
    sample_rows = [i for i, s in enumerate(states) if s.num_computed_tokens >= len(s.token_ids)]
    if not sample_rows:
        return ModelRunnerOutput(prompt_logprobs=prompt_logprobs)
    num_drafts = {i: len(drafts.get(states[i].req_id, ())) for i in sample_rows}
    # the hidden rows of each request's positions: its last token's, then its proposals'
    offsets, rows = {}, []
    for i in sample_rows:
        offsets[i] = len(rows)
        first = int(qsl[i + 1]) - 1 - num_drafts[i]
        rows.extend(range(first, first + num_drafts[i] + 1))
    logits_all = runner.model.compute_logits(hidden.index_select(0, torch.as_tensor(rows, device=hidden.device)))
    tokens: dict[int, list[int]] = {i: [] for i in sample_rows}
    lps: dict[int, list[Logprobs]] = {i: [] for i in sample_rows}
    errors: dict[str, str] = {}

    def sample(active: list[int], positions: list[int]) -> list[tuple[int, int, Any, int] | None]:
        """Sample the rows (request i, position j): [(i, token, out, row)], None where a
        row failed (noted in `errors`)."""
        ids = [states[i].req_id for i in active]
        index = torch.as_tensor([offsets[i] + j for i, j in zip(active, positions)], device=logits_all.device)
        logits = logits_all.index_select(0, index)
        if runner._grammar[0]:
            # each position of a request under a grammar has its own row (the state after
            # the proposals before it); the other requests' rows allow everything
            logits = runner._mask_logits(logits, ids, positions)
        out = runner.sampler(logits, runner.sampling.make_metadata(ids, logits.device))
        sampled = out.sampled_token_ids
        if runner.tp_size > 1 and runner.communicator is not None:
            sampled = runner.communicator.broadcast(sampled.to(runner.device).contiguous(), src=0).cpu()
        failed = dict(out.failed_rows)
        for row, req_id in enumerate(ids):
            if row in failed:
                errors[req_id] = failed[row]
        return [None if row in failed else (i, token, out, row) for row, (i, token) in enumerate(zip(active, sampled.tolist()))]

    def keep(i: int, token: int, out: Any, row: int, position: int) -> bool:
        """Record the token of position `position`; True when it equals the proposal there."""
        req_id = states[i].req_id
        runner.sampling.append_output(req_id, token)
        tokens[i].append(token)
        k = runner.sampling.num_logprobs(req_id)
        if k is not None and out.logprobs is not None:
            lps[i].append(Logprobs(token_id=token, logprob=float(out.logprobs[row]), rank=int(out.ranks[row]),
                                   top_token_ids=tuple(out.top_token_ids[row, :k].tolist()),
                                   top_logprobs=tuple(out.top_logprobs[row, :k].tolist())))
        proposed = drafts.get(req_id, ())
        return position < len(proposed) and token == proposed[position]

    if all(runner.sampling.history_free_greedy(states[i].req_id) for i in sample_rows):
        # every position's token is the argmax of its own logits: one sampler call for all
        pairs = [(i, j) for i in sample_rows for j in range(num_drafts[i] + 1)]
        drawn: dict[tuple[int, int], tuple] = {}
        for (i, j), got in zip(pairs, sample([p[0] for p in pairs], [p[1] for p in pairs])):
            if got is not None:
                drawn[(i, j)] = got[1:]
        for i in sample_rows:
            j = 0
            while (i, j) in drawn and keep(i, *drawn[(i, j)], j):
                j += 1
    else:
        # position after position: each draw sees the outputs kept before it
        active, position = list(sample_rows), 0
        while active:
            active = [got[0] for got in sample(active, [position] * len(active))
                      if got is not None and keep(*got, position)]
            position += 1
    sampled_ids: dict[str, int] = {}
    accepted: dict[str, tuple[int, ...]] = {}
    accepted_lps: dict[str, tuple[Logprobs, ...]] = {}
    logprobs: dict[str, Logprobs] = {}
    for i in sample_rows:
        state = states[i]
        if state.req_id in errors:
            continue
        new = tokens[i]
        # the proposals leave the known tokens; what was sampled takes their place
        del state.token_ids[len(state.token_ids) - num_drafts[i]:]
        state.token_ids.extend(new)
        state.num_computed_tokens = len(state.token_ids) - 1
        sampled_ids[state.req_id] = new[-1]
        if len(new) > 1:
            accepted[state.req_id] = tuple(new[:-1])
        if lps[i]:
            logprobs[state.req_id] = lps[i][-1]
            if len(lps[i]) > 1:
                accepted_lps[state.req_id] = tuple(lps[i][:-1])
    return ModelRunnerOutput(sampled_token_ids=sampled_ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                             errors=errors, accepted_token_ids=accepted, accepted_logprobs=accepted_lps)
