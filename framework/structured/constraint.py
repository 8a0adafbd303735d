"""The data of a structured-outputs constraint (no torch: the front end imports it).

See `portaserve.framework.interfaces.structured_output` for the backend contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: the kinds of constraint a request may carry (StructuredOutputsParams' fields)
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag", "tool_calls")


class GrammarError(ValueError):
    """The constraint is invalid or uses a feature the backend lacks (a 400 for the request)."""


@dataclass(frozen=True)
class VocabInfo:
    """The model's vocabulary as a backend needs it."""

    #: the tokenizers library's JSON of the tokenizer (token strings, decoder, added tokens)
    tokenizer_json: str
    #: token id -> token string as the tokenizer stores it ("" for ids past the tokenizer's)
    encoded_vocab: tuple[str, ...]
    #: the model's vocabulary size (logits width; may exceed the tokenizer's)
    vocab_size: int
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: `kind` (one of CONSTRAINT_KINDS) and its text (a JSON
    schema as JSON, a regex, a grammar, choices as a JSON list). "tool_calls": JSON of
    {"prefix", "suffix", "separator", "schemas", "max_calls"}: 1 to max_calls calls, each
    prefix + a JSON value of one of the schemas + suffix, joined by the separator (a tool
    parser's format, e.g. hermes' "<tool_call>\n" ... "\n</tool_call>")."""

    kind: str
    spec: str
    #: no optional whitespace in JSON: only the separators ", " and ": " (vLLM's disable_any_whitespace)
    compact_json: bool = False
    #: "ebnf" (GBNF, llama.cpp's format) or "lark", for kind "grammar"
    grammar_syntax: str = "ebnf"


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def choice_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of `choices` (escaped)."""
    import re

    return "(" + "|".join(re.escape(c) for c in choices) + ")"
