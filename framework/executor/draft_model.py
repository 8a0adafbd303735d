"""Speculative decoding's draft model, the runner's side: a smaller model with the
target's tokenizer that proposes each speculating request's next k tokens, greedily.

It runs on the target's platform and device with weights, attention backends and a KV
cache of its own. The cache has as many blocks as the target's and is addressed through
the same block tables, so a position's slot is the same in both caches and the
scheduler's allocation covers the draft: the step allocated the request's last token
and its k places, and the draft writes the KV of positions up to n + k - 2 only.

What the draft proposes never changes the output (the target verifies every token, see
speculation.py), only how many proposals are accepted. That is why its bookkeeping can
stay simple: per request, the tokens whose KV its cache holds (`_Progress`). While the
target computes a prompt, the draft computes the same chunks in the same step (`follow`),
prefix-cached tokens included (the draft KV of prefix-cached blocks is not trusted: a
block may have been cached by a request whose draft never ran over it). After a
verification the positions up to the first rejected proposal are still right, and the
next proposal first catches up from there: the tokens the target sampled.

The draft runs through its own forward of the plan's compilation choice (decode graphs on
the CPU): every draft step of a proposal is a pure decode, its catch-up after a
verification included (the few tokens become one-token queries, as in
speculation.decode_rows). Prompts are prefills, in chunks of the step's token budget.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from portaserve.framework.executor.compile import EagerForward, build_forward
from portaserve.framework.executor.input_batch import RequestState, build_inputs
from portaserve.framework.executor.model_builder import build_model
from portaserve.framework.executor.speculation import decode_rows
from portaserve.framework.layer_context import LayerContext, StepContext

logger = logging.getLogger("portaserve")


@dataclass(slots=True)
class _Progress:
    """The tokens a request's draft KV holds: `valid` positions known right, then `tail`
    (proposals written past them, which the target may have rejected since)."""

    valid: int = 0
    tail: tuple[int, ...] = ()

    def known_right(self, tokens: list[int]) -> int:
        """Positions whose draft KV matches `tokens` (the request's known tokens now)."""
        n = self.valid
        for token in self.tail:
            if n >= len(tokens) or tokens[n] != token:
                break
            n += 1
        return n


class DraftModel:
    """The draft model of one rank: `propose(states, ks)` -> k tokens per request."""

    def __init__(self, spec: Any, registry: Any, platform: Any, local_rank: int = 0, tp_rank: int = 0,
                 tp_size: int = 1, communicator: Any = None, max_tokens_per_step: int = 2048,
                 max_num_seqs: int = 128, num_speculative_tokens: int = 4) -> None:
        self.spec = spec
        self.registry = registry
        self.platform, self.local_rank = platform, local_rank
        self.device = platform.torch_device(local_rank)
        self.max_num_seqs = max_num_seqs
        self.max_catch_up_rows = num_speculative_tokens + 1  # a verification's accepted tokens plus its sampled one
        self.tp_rank, self.tp_size, self.communicator = tp_rank, tp_size, communicator
        self.block_size = spec.plan.block_size
        self.max_tokens_per_step = max(1, max_tokens_per_step)
        arch_cls = spec.plan.model_class(registry)
        self.layer_types = list(arch_cls.attention_layer_types(spec.hf_config))
        context = LayerContext.from_plan(spec.plan, registry, self.device, tp_rank, tp_size)
        self.backends = {t: b for t, b in context.attention_backends().items() if t in self.layer_types}
        self.model = None
        self.forward: EagerForward | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.progress: dict[str, _Progress] = {}
        self.never: set[str] = set()  # requests that get no proposals (under a grammar): not followed
        # a draft may have fewer embedding rows than the target (padding): ids past them are
        # clamped to its last row before its embedding (they change only what it proposes)
        self.vocab_size = spec.vocab_size
        self.num_forwards = 0  # draft forward passes run (tests, profiling)
        self.num_caught_up = 0  # the most tokens a proposal had to catch up on in one forward (tests)

    def load(self) -> None:
        self.model = build_model(self.spec.plan, self.registry, self.spec.model_path, self.device,
                                 tp_rank=self.tp_rank, tp_size=self.tp_size, communicator=self.communicator)
        backend = self.spec.plan.compile_backend
        capture = self.platform.graph_capture(backend, self.local_rank) if backend is not None else None
        # a step's rows: each speculating request's catch-up as one-token queries, then one each
        self.forward = build_forward(self.model, self.spec.plan, max_num_seqs=self.max_num_seqs * self.max_catch_up_rows,
                                     max_model_len=self.spec.max_model_len, graph_capture=capture)

    def kv_cache_bytes_per_block(self) -> int:
        return sum(self.backends[t].kv_cache_bytes_per_block() for t in self.layer_types)

    def initialize_kv_cache(self, allocator: Any, num_blocks: int) -> None:
        self.forward.set_num_blocks(num_blocks)
        self.progress.clear()
        reserved = self.forward.num_reserved_blocks  # the decode graphs' padding sink
        shapes = [self.backends[t].kv_cache_shape(num_blocks + reserved) for t in self.layer_types]
        dtypes = [self.backends[t].kv_cache_torch_dtype() for t in self.layer_types]
        self.kv_caches = allocator.allocate(shapes, dtypes)

    def release_kv_cache(self, allocator: Any) -> None:
        allocator.release(self.kv_caches)
        self.kv_caches = []

    def forget(self, req_id: str) -> None:
        """A request finished or was preempted (its blocks are gone)."""
        self.progress.pop(req_id, None)
        self.never.discard(req_id)

    # ----- proposing ---------------------------------------------------------------------

    def follow(self, states: Sequence[RequestState]) -> None:
        """After a step without proposals for `states`: compute the draft KV of the tokens
        the target computed (prompt chunks, prefix-cached prompts, resumed requests) when
        the draft is more than a proposal's catch-up behind, so a request's first proposal
        catches up on a few tokens, not its whole prompt. Smaller gaps are left to `propose`
        (one-token rows)."""
        rows, ends = [], []
        for state in states:
            if state.req_id in self.never:
                continue
            progress = self.progress.setdefault(state.req_id, _Progress())
            start = progress.known_right(state.token_ids)
            if state.num_computed_tokens - start > self.max_catch_up_rows:
                rows.append(dataclasses.replace(state, num_computed_tokens=start))
                ends.append(state.num_computed_tokens)
                self.progress[state.req_id] = _Progress(state.num_computed_tokens)
        if rows:
            self._catch_up(rows, ends, sample=False)

    def propose(self, states: Sequence[RequestState], ks: Sequence[int]) -> dict[str, tuple[int, ...]]:
        """The next `ks[i]` tokens of each request, each the draft's argmax given the ones
        before it. `states[i].token_ids` are the request's known tokens."""
        rows = []
        for state in states:
            tokens = list(state.token_ids)
            start = min(self.progress.setdefault(state.req_id, _Progress()).known_right(tokens), len(tokens) - 1)
            rows.append(dataclasses.replace(state, token_ids=tokens, num_computed_tokens=start))
        # catch up: each request's tokens the draft has not seen, the last one's logits giving d1
        first = self._catch_up(rows, [len(row.token_ids) for row in rows], sample=True)
        proposals: dict[int, list[int]] = {i: [first[i]] for i in range(len(rows))}
        # then one token per round: d(j) in, d(j + 1) out
        for j in range(1, max(ks, default=0)):
            active = [i for i, k in enumerate(ks) if k > j]
            for i in active:
                rows[i].token_ids.append(proposals[i][-1])
            for i, token in zip(active, self._forward([rows[i] for i in active], [1] * len(active))):
                proposals[i].append(token)
                rows[i].num_computed_tokens += 1
        out = {}
        for i, (state, k) in enumerate(zip(states, ks)):
            out[state.req_id] = tuple(proposals[i][:k])
            # the draft KV now holds the known tokens, then the proposals but the last
            self.progress[state.req_id] = _Progress(len(state.token_ids), out[state.req_id][:-1])
        return out

    def _catch_up(self, rows: list[RequestState], ends: list[int], sample: bool) -> dict[int, int]:
        """Run each row from its computed tokens to `ends[i]`, in chunks of the step's token
        budget; with `sample`, the argmax after each row's last token, by row index."""
        out: dict[int, int] = {}
        pending = list(range(len(rows)))
        while pending:
            chosen, counts, budget = [], [], self.max_tokens_per_step
            for i in pending:
                if budget <= 0:
                    break
                count = min(ends[i] - rows[i].num_computed_tokens, budget)
                chosen.append(i)
                counts.append(count)
                budget -= count
            done = [i for i, c in zip(chosen, counts) if sample and rows[i].num_computed_tokens + c == ends[i]]
            for i, token in zip(done, self._forward([rows[i] for i in chosen], counts, done_of=chosen, done=done)):
                out[i] = token
            for i, c in zip(chosen, counts):
                rows[i].num_computed_tokens += c
                if sample:
                    self.num_caught_up = max(self.num_caught_up, c)
            pending = [i for i in pending if rows[i].num_computed_tokens < ends[i]]
        return out

    def _forward(self, rows: list[RequestState], counts: list[int], done_of: list[int] | None = None,
                 done: list[int] | None = None) -> list[int]:
        """Run the draft over `counts[i]` new tokens of each row; the argmax token after the
        last row of each request (of those in `done`, when given)."""
        if max(counts) <= self.max_catch_up_rows:
            # one-token queries (the decode path, which the forward may replay from a graph)
            split = {row.req_id: (0,) * (count - 1) for row, count in zip(rows, counts) if count > 1}
            host = decode_rows(rows, counts, split, self.block_size, with_kv_cache=True)
        else:
            host = build_inputs(rows, counts, self.block_size, with_kv_cache=True)
        batch, input_ids, positions = self.forward.prepare(host.batch, host.input_ids, host.positions)
        metadata = {t: backend.build_metadata(batch) for t, backend in self.backends.items()}
        step = StepContext(attn_metadata=metadata, kv_caches=self.kv_caches, query_start_loc=batch.query_start_loc)
        input_ids = input_ids.clamp(max=self.vocab_size - 1) if int(input_ids.max()) >= self.vocab_size else input_ids
        hidden = self.forward(input_ids.to(self.device), positions.to(self.device), step)[: host.batch.num_actual_tokens]
        self.num_forwards += 1
        ends = host.query_start_loc[1:] - 1
        if done is not None:
            wanted = set(done)
            ends = [int(e) for i, e in zip(done_of, ends) if i in wanted]
        if len(ends) == 0:
            return []
        logits = self.model.compute_logits(hidden.index_select(0, torch.as_tensor(ends, device=hidden.device)))
        tokens = logits.argmax(dim=-1)
        if self.tp_size > 1 and self.communicator is not None:
            tokens = self.communicator.broadcast(tokens.to(self.device).contiguous(), src=0)
        return tokens.cpu().tolist()
