"""The engine core's side of structured outputs.

- The backend (the plan's `structured_outputs` choice) is built on first use from the
  model's tokenizer, loaded here: the engine core otherwise has none.
- A request's constraint compiles on a worker thread, cached by the constraint (the
  same schema from many requests compiles once; `n` > 1 children share it). The
  scheduler keeps the request out of the waiting queue until `poll` says it is ready,
  so a slow compile blocks no other request; one past COMPILE_TIMEOUT_S fails that
  request alone.
- Each sequence has its own matcher. Before a step, `bitmask` fills one row per
  sequence that samples in it; after, `accept` advances the matcher by the sampled
  token. Tokens are only ever appended (preemption recomputes the KV cache but keeps
  the tokens), so matchers never need to go back for that.
- Speculative proposals (n-gram) are constrained too: `draft_rows` walks the matcher
  over them, keeps the longest prefix the grammar allows, fills one row per position
  (the position's state after the proposals before it) and rolls the matcher back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from portaserve.framework.errors import invalid
from portaserve.framework.interfaces.structured_output import Constraint, GrammarError, VocabInfo, bitmask_words

logger = logging.getLogger("portaserve")

COMPILE_TIMEOUT_S = 30.0
CACHE_SIZE = 256
#: tokens a matcher can roll back (speculative proposals)
MAX_ROLLBACK_TOKENS = 16


@dataclass
class GrammarState:
    """A request's grammar: the compile in flight, then its matcher."""

    future: Future
    submitted: float = field(default_factory=time.monotonic)
    matcher: Any = None
    error: str | None = None
    #: a reasoning model still inside its reasoning section: not constrained yet
    reasoning_end: tuple[int, ...] = ()


class StructuredOutputManager:
    def __init__(self, spec: Any, backend_name: str, registry: Any = None) -> None:
        self.spec = spec
        self.backend_name = backend_name
        self._registry = registry
        self._backend = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self._fill_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-bitmask")
        self._cache: OrderedDict[Constraint, Future] = OrderedDict()
        self.num_compiled = 0

    # ----- the backend --------------------------------------------------------------------

    def backend(self):
        with self._lock:
            if self._backend is None:
                if self.backend_name == "none":
                    raise invalid("structured_outputs", "no structured-outputs backend is installed "
                                  "(pip install xgrammar, or llguidance)")
                from portaserve.framework.engine.tokenizer import Tokenizer
                from portaserve.framework.plugins import get_registry

                tokenizer = Tokenizer.from_pretrained(self.spec.tokenizer_path)
                registry = self._registry or get_registry()
                self._backend = registry.get("structured_output_backends", self.backend_name)(vocab_info(self.spec, tokenizer))
            return self._backend

    # ----- requests ---------------------------------------------------------------------------

    def submit(self, request: Any) -> None:
        """Start compiling the request's constraint (or reuse the cached compile)."""
        constraint = request.sampling_params.structured_outputs.constraint()
        with self._lock:
            future = self._cache.get(constraint)
            if future is None:
                future = self._pool.submit(self._compile, constraint)
                self._cache[constraint] = future
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(constraint)
        request.grammar = GrammarState(future, reasoning_end=tuple(request.sampling_params.structured_outputs.reasoning_end or ()))

    def _compile(self, constraint: Constraint):
        started = time.perf_counter()
        compiled = self.backend().compile(constraint)
        self.num_compiled += 1
        logger.debug("compiled a %s constraint in %.3fs", constraint.kind, time.perf_counter() - started)
        return compiled

    def poll(self, request: Any) -> bool:
        """True once the request's matcher is ready; False while compiling. Sets
        `request.grammar.error` (and returns True) when the compile failed or timed out."""
        state = request.grammar
        if state.matcher is not None or state.error is not None:
            return True
        if not state.future.done():
            if time.monotonic() - state.submitted > COMPILE_TIMEOUT_S:
                state.error = (f"{request.sampling_params.structured_outputs.field_name}: the constraint took longer "
                               f"than {COMPILE_TIMEOUT_S:.0f}s to compile")
                with self._lock:  # a later request with it must not wait on the same compile
                    for key, fut in list(self._cache.items()):
                        if fut is state.future:
                            del self._cache[key]
                return True
            return False
        exc = state.future.exception()
        if exc is not None:
            name = request.sampling_params.structured_outputs.field_name
            state.error = f"{name}: {exc}" if isinstance(exc, GrammarError) else f"{name}: {type(exc).__name__}: {exc}"
            return True
        state.matcher = state.future.result().matcher(MAX_ROLLBACK_TOKENS)
        tokens, request.output_token_ids = list(request.output_token_ids), []
        for token in tokens:  # a resumed request's earlier tokens
            self.accept(request, token)
            request.output_token_ids.append(token)
        return True

    def bitmask(self, requests: list[Any], draft_rows: dict[str, Any] | None = None
                ) -> tuple[tuple[str, ...], "PendingBitmask | bytes", tuple[int, ...]]:
        """(request ids, their int32 bitmask rows, rows per request) for the sequences that
        sample this step: one row each, or one per position for a request with proposals
        (`draft_rows`, made by `draft_rows` while scheduling). The single rows are filled
        on a worker thread while the model runs: the runner waits for them only when it
        samples (a PendingBitmask; it pickles as the finished bytes)."""
        requests = [r for r in requests if not r.grammar.reasoning_end]
        if not requests:
            return (), b"", ()
        draft_rows = draft_rows or {}
        made = [draft_rows.get(r.request_id) for r in requests]
        counts = tuple(1 if rows is None else rows.shape[0] for rows in made)
        matchers = [r.grammar.matcher for r, rows in zip(requests, made) if rows is None]
        future = self._fill_pool.submit(self._fill, matchers, made, sum(counts))
        return tuple(r.request_id for r in requests), PendingBitmask(future), counts

    def _fill(self, matchers: list[Any], made: list[Any] | None = None, num_rows: int | None = None) -> bytes:
        import torch

        words = bitmask_words(self.spec.vocab_size)
        fresh = torch.full((len(matchers), words), -1, dtype=torch.int32)
        if matchers:
            self.backend().fill_bitmasks(matchers, fresh)
        if not made or all(rows is None for rows in made):
            return fresh.numpy().tobytes()
        parts, next_fresh = [], 0
        for rows in made:  # in request order: the precomputed rows, or the next fresh one
            if rows is None:
                parts.append(fresh[next_fresh:next_fresh + 1])
                next_fresh += 1
            else:
                parts.append(rows)
        return torch.cat(parts).numpy().tobytes()

    def draft_rows(self, request: Any, drafts: tuple[int, ...]) -> tuple[tuple[int, ...], Any]:
        """The longest prefix of `drafts` the request's grammar allows (at most
        MAX_ROLLBACK_TOKENS), and its bitmask rows: row j is the state after the first j
        proposals, for sampling position j. The matcher ends where it started."""
        import torch

        matcher = request.grammar.matcher
        drafts = drafts[:MAX_ROLLBACK_TOKENS]
        rows = torch.full((len(drafts) + 1, bitmask_words(self.spec.vocab_size)), -1, dtype=torch.int32)
        advanced, ended = 0, False
        try:
            for j in range(len(drafts) + 1):
                matcher.fill_bitmask(rows, j)
                if j == len(drafts):
                    break
                token = drafts[j]
                # the row says whether the grammar takes the token (a refused token would
                # leave some matchers in an error state that no rollback undoes)
                if not (int(rows[j, token // 32]) >> (token % 32)) & 1 or not matcher.accept_token(token):
                    break
                advanced += 1
                if matcher.is_terminated():
                    # a stop token ended the grammar: a terminated matcher has no next-token
                    # mask, so it is not proposed; the verification samples it itself, at
                    # this position, under this position's row
                    ended = True
                    break
        finally:
            if advanced:
                matcher.rollback(advanced)
        kept = advanced - ended
        return drafts[:kept], rows[:kept + 1].clone()

    def accept_all(self, request: Any, tokens: tuple[int, ...]) -> int | None:
        """`accept` each of a step's tokens in order (accepted proposals, then the sampled
        one) up to the first that ends the request (the tokens after it are not output);
        the first the grammar refuses, or None when it takes them all."""
        params = request.sampling_params
        stops = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stops |= set(request.eos_token_ids)
        for token in tokens:
            if not self.accept(request, token):
                return token
            if token in stops:
                break
        return None

    def accept(self, request: Any, token: int) -> bool:
        """Advance the request's matcher (`token` is not yet in its output); False when the
        grammar refuses the token. Inside a reasoning section only the end is watched for."""
        state = request.grammar
        if state.reasoning_end:
            end = state.reasoning_end
            tail = [*request.output_token_ids[-(len(end) - 1):], token] if len(end) > 1 else [token]
            if tuple(tail[-len(end):]) == end:
                state.reasoning_end = ()  # constrained from the next token on
            return True
        return state.matcher.accept_token(token)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)


class PendingBitmask:
    """A step's bitmask rows being filled; `result()` waits for the bytes. Sent to worker
    processes it crosses as the finished bytes (no overlap there, the same rows)."""

    __slots__ = ("_future",)

    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self) -> bytes:
        return self._future.result()

    #: what crosses to worker processes (framework/wire.py)
    wire_value = result

    def __reduce__(self):
        return (bytes, (self.result(),))


def vocab_info(spec: Any, tokenizer: Any) -> VocabInfo:
    """The model's vocabulary for a backend: the tokenizer's token strings padded to the
    logits width, and the stop tokens (the tokenizer's EOS ids and the checkpoint's)."""
    backend = tokenizer.backend
    size = max(spec.vocab_size, backend.get_vocab_size(with_added_tokens=True))
    encoded = [""] * size
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if index < size:
            encoded[index] = token
    stops = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    eos = spec.hf_config.get("eos_token_id")
    stops |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return VocabInfo(backend.to_str(), tuple(encoded[: spec.vocab_size]), spec.vocab_size, tuple(sorted(stops)))
