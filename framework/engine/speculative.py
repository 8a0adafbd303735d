"""Speculative decoding, the scheduler's side: proposals, and their bookkeeping.

Config in vLLM's shape (`--speculative-config '{"method": "ngram", "num_speculative_tokens":
4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'`, or `'{"model": PATH,
"num_speculative_tokens": 4}'` for a draft model): `SpeculativeConfig.parse`.

Each step, a running request that is decoding gets up to `num_speculative_tokens`
proposed tokens: `NgramProposer` (prompt lookup, no extra model) proposes them here; a
draft model runs in the worker (executor/draft_model.py), so the scheduler schedules
that many `DRAFT_MODEL_SLOT` places which the runner fills before the forward. The scheduler
schedules them with the request's last token, so one forward pass of the target model
computes every position; the runner then samples position after position exactly as
without speculation (same sampling parameters, penalties and seeded draws) and keeps a
proposal only while it equals the token sampled at its position. The output is 1 to
k + 1 tokens per step, token-identical to decoding without speculation for greedy and
seeded requests, and distributed exactly as without it otherwise: with a proposal that
is one token (not a distribution), rejection sampling accepts it with probability p(d)
and, on rejection, draws from p without d, which is what drawing x ~ p and comparing it
with d does (see executor/speculation.py).

KV slots: the proposals' positions are allocated with the step; after it, the request's
computed tokens roll back to its accepted ones (`rollback`), so the rejected positions'
slots are written again by the next step. Proposals are never hashed into the prefix
cache (block_manager.py hashes known tokens only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from portaserve.framework.errors import invalid

from .request import Request
from .scheduler_output import DRAFT_MODEL_SLOT

METHODS = ("ngram", "draft_model")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "gguf_file")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model (method "draft_model"): a folder or a GGUF file
    gguf_file: str | None = None  # the draft's GGUF file inside `model`, when that is a folder

    def to_dict(self) -> dict[str, Any]:
        """The keys `parse` takes back (the n-gram range only for method 'ngram')."""
        skip = {"prompt_lookup_min", "prompt_lookup_max"} if self.method == "draft_model" else set()
        return {key: getattr(self, key) for key in KEYS if getattr(self, key) is not None and key not in skip}

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """From the flag's JSON text or a dict (vLLM's key names); None stays None."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise invalid("speculative_config", f"not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise invalid("speculative_config", "must be a JSON object such as "
                                                '{"method": "ngram", "num_speculative_tokens": 4}')
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise invalid("speculative_config", f"unknown key(s) {unknown}; known: {sorted(KEYS)}")
        model, gguf_file = value.get("model"), value.get("gguf_file")
        method = value.get("method", "draft_model" if model is not None else "ngram")
        if method not in METHODS:
            raise invalid("speculative_config", f"method {method!r}; supported: {', '.join(METHODS)}")
        for name, v in (("model", model), ("gguf_file", gguf_file)):
            if v is not None and (not isinstance(v, str) or not v or len(v) > 4096):
                raise invalid("speculative_config", f"{name} must be a non-empty path, got {v!r}")
        if (method == "draft_model") != (model is not None) or (gguf_file is not None and model is None):
            raise invalid("speculative_config", "method 'draft_model' takes a 'model' (the draft's folder or GGUF "
                                                "file, and 'gguf_file' in a folder) and method 'ngram' neither")
        if method == "draft_model" and {"prompt_lookup_min", "prompt_lookup_max"} & set(value):
            raise invalid("speculative_config", "prompt_lookup_min / prompt_lookup_max apply to method 'ngram' only")
        k = value.get("num_speculative_tokens", 4)
        lo, hi = value.get("prompt_lookup_min", 2), value.get("prompt_lookup_max", value.get("prompt_lookup_min", 4))
        for name, v in (("num_speculative_tokens", k), ("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64:
                raise invalid("speculative_config", f"{name} must be an integer in [1, 64], got {v!r}")
        if lo > hi:
            raise invalid("speculative_config", f"prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
        return cls(method, k, lo, hi, model, gguf_file)


class NgramProposer:
    """Prompt lookup: the continuation of the latest earlier occurrence of the sequence's
    last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, tokens: list[int], k: int) -> tuple[int, ...]:
        if k <= 0 or len(tokens) <= self.min_n:
            return ()
        import numpy as np  # here: importing numpy starts BLAS threads, and the engine process forks only single-threaded

        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            pattern = seq[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the token after the latest earlier match
                return tuple(seq[start:start + k].tolist())
        return ()


class DraftModelSlots:
    """The scheduler's side of a draft model: k places per decoding request, which the
    runner's draft model fills (executor/draft_model.py)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens

    def propose(self, tokens: list[int], k: int) -> tuple[int, ...]:
        return (DRAFT_MODEL_SLOT,) * k


def make_proposer(config: SpeculativeConfig | None) -> NgramProposer | DraftModelSlots | None:
    if config is None:
        return None
    return DraftModelSlots(config) if config.method == "draft_model" else NgramProposer(config)


def may_speculate(request: Request, proposer: NgramProposer | DraftModelSlots) -> bool:
    """Requests under a grammar speculate with n-gram proposals, which the scheduler walks
    the grammar over (structured/manager.py draft_rows); a draft model's proposals are made
    in the worker, where no grammar is, so they decode one token at a time. Inside a
    reasoning section (not yet constrained) they do not speculate either."""
    grammar = request.grammar
    return grammar is None or (isinstance(proposer, NgramProposer) and not grammar.reasoning_end)


def draft_limit(request: Request, k: int, max_model_len: int) -> int:
    """Proposals worth scheduling: none past max_tokens or the context (a token sampled
    after the last allowed one would be thrown away)."""
    left_output = request.max_tokens - len(request.output_token_ids) - 1
    left_context = max_model_len - request.num_tokens - 1
    return max(0, min(k, left_output, left_context))


def next_num_drafts(proposed: int, accepted: int, max_k: int) -> int:
    """How many tokens to propose for a request next step: all of them again after a step
    that accepted all, else one more than were accepted. Verifying a proposal costs a
    row of the forward pass, and a request whose proposals keep failing (free text that
    only looks like its context) then pays for one row, not k."""
    return max_k if accepted >= proposed else min(max_k, accepted + 1)


@dataclass
class SpecStats:
    """Cumulative counters for metrics: steps with proposals, proposed and accepted tokens."""

    max_k: int = 4
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
