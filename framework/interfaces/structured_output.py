"""Structured-output backends: grammars that constrain sampling (contract 1.5).

A backend (xgrammar, llguidance, a vendor's) is registered by name through
`portaserve_structured_output_backends`. The engine core builds one instance per
engine from the model's vocabulary (`VocabInfo`), compiles each request's constraint
with `compile` (off the engine loop, cached by the constraint), and drives one
`GrammarMatcher` per sequence: before a step samples the sequence, `fill_bitmask` marks
the tokens the grammar allows next; after, `accept_token` advances it. The sampler
masks every other token out (the `apply_token_bitmask` op), and the stop tokens are
allowed only where the grammar may end.

Bitmasks are int32 arrays [rows, ceil(vocab_size / 32)]: bit j of word i allows token
32 * i + j (xgrammar's and llguidance's layout).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

# The plain data of the contract lives in a torch-free module (requests carry it through
# the front end before the engine process starts); re-exported here.
from portaserve.framework.structured.constraint import (  # noqa: E402,F401
    CONSTRAINT_KINDS,
    Constraint,
    GrammarError,
    VocabInfo,
    bitmask_words,
    choice_regex,
)


class GrammarMatcher(ABC):
    """The state of one sequence in its grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` (a CPU int32 torch tensor)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding, preemption)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar has ended (only a stop token could follow)."""


class CompiledGrammar(ABC):
    """A compiled constraint, shared by every sequence that uses it (cached by the engine)."""

    @abstractmethod
    def matcher(self, max_rollback_tokens: int = 0) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one vocabulary."""

    name: ClassVar[str]
    #: CONSTRAINT_KINDS this backend compiles
    supported_kinds: ClassVar[frozenset[str]]
    #: importable modules the backend needs (the plan skips a backend whose library is missing)
    requires: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why the backend cannot run here (a missing library), or None."""
        import importlib.util

        missing = [m for m in cls.requires if importlib.util.find_spec(m) is None]
        return f"needs {', '.join(missing)} (pip install {' '.join(missing)})" if missing else None

    def __init__(self, vocab: VocabInfo) -> None:
        self.vocab = vocab

    @classmethod
    def validate(cls, constraint: Constraint) -> None:
        """Cheap checks that need no vocabulary (the front end calls it before accepting
        the request); raises GrammarError naming the problem. The default checks the kind."""
        if constraint.kind not in cls.supported_kinds:
            raise GrammarError(f"the {cls.name} backend does not support {constraint.kind!r} constraints; "
                               f"it supports {sorted(cls.supported_kinds)}")

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: Any) -> None:
        """Row i of `bitmask` for `matchers[i]` (a step's sequences together; a backend may
        fill them in parallel). Called on a worker thread while the model runs."""
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)

    @abstractmethod
    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile (possibly slow: the engine calls it on a worker thread, with a time
        limit); raises GrammarError for an invalid constraint."""
