"""The llguidance backend (vLLM's alternative): JSON schemas, regexes, GBNF and Lark
grammars, computed lazily per token by an Earley parser (no compile step to speak of)."""

from __future__ import annotations

import json
from typing import Any

from portaserve.framework.interfaces.structured_output import (
    CompiledGrammar,
    Constraint,
    GrammarError,
    GrammarMatcher,
    StructuredOutputBackend,
    VocabInfo,
)


class LlguidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.consume_token(int(token_id))) and not self._m.is_error()

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())


class LlguidanceCompiled(CompiledGrammar):
    def __init__(self, tokenizer: Any, grammar: str) -> None:
        self._tokenizer = tokenizer
        self._grammar = grammar

    def matcher(self, max_rollback_tokens: int = 0) -> GrammarMatcher:
        import llguidance

        m = llguidance.LLMatcher(self._tokenizer, self._grammar)
        if m.is_error():
            raise GrammarError(m.get_error())
        return LlguidanceMatcher(m)


class LlguidanceBackend(StructuredOutputBackend):
    name = "llguidance"
    supported_kinds = frozenset({"json", "json_object", "regex", "choice", "grammar", "tool_calls"})
    requires = ("llguidance",)

    def __init__(self, vocab: VocabInfo) -> None:
        super().__init__(vocab)
        import llguidance

        eos = vocab.stop_token_ids[0] if vocab.stop_token_ids else None
        self._tokenizer = llguidance.LLTokenizer(vocab.tokenizer_json, n_vocab=vocab.vocab_size, eos_token=eos)
        # added tokens (<tool_call>, ...) are special to llguidance: literals name them by id
        added = json.loads(vocab.tokenizer_json).get("added_tokens") or []
        self._added = {t["content"]: int(t["id"]) for t in added if t.get("content") and int(t["id"]) < vocab.vocab_size}

    @classmethod
    def validate(cls, constraint: Constraint) -> None:
        super().validate(constraint)
        import llguidance

        grammar = _grammar(constraint)
        ok, message = _check(llguidance.LLMatcher.validate_grammar(grammar))
        if not ok:
            raise GrammarError(message)

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: Any) -> None:
        """In parallel, on llguidance's own threads (a row inside a JSON string costs over a
        millisecond: `python benchmarks/grammar_ops.py`)."""
        import llguidance
        from llguidance.torch import fill_next_token_bitmask_par

        if len(matchers) < 2:
            return super().fill_bitmasks(matchers, bitmask)
        if getattr(self, "_executor", None) is None:
            self._executor = llguidance.LLExecutor()
        fill_next_token_bitmask_par(self._executor, [(m._m, row) for row, m in enumerate(matchers)], bitmask)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        import llguidance

        grammar = _grammar(constraint, self._added)
        ok, message = _check(llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer))
        if not ok:
            raise GrammarError(message)
        return LlguidanceCompiled(self._tokenizer, grammar)


def _check(result: Any) -> tuple[bool, str]:
    message = result if isinstance(result, str) else str(result or "")
    return (not message, message[:500])


def _grammar(c: Constraint, added: dict[str, int] | None = None) -> str:
    import llguidance

    try:
        if c.kind in ("json", "json_object"):
            schema = c.spec if c.kind == "json" else '{"type": "object"}'
            # compact: no optional whitespace, the separators json.dumps writes (", ", ": "), as xgrammar
            defaults: dict = {"whitespace_flexible": not c.compact_json}
            if c.compact_json:
                defaults.update(item_separator=", ", key_separator=": ")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
        if c.kind == "regex":
            return llguidance.grammar_from("regex", c.spec)
        if c.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(json.loads(c.spec)))
        if c.kind == "grammar":
            return llguidance.grammar_from("lark" if c.grammar_syntax == "lark" else "gbnf", c.spec)
        if c.kind == "tool_calls":
            return llguidance.grammar_from("lark", _tool_calls_lark(json.loads(c.spec), c.compact_json, added or {}))
    except ValueError as exc:
        raise GrammarError(str(exc)[:500]) from None
    raise GrammarError(f"the llguidance backend does not support {c.kind!r} constraints")


def _literal(text: str, added: dict[str, int]) -> str:
    """`text` as Lark: JSON-quoted strings, and `<[id]>` for the added tokens in it."""
    parts, plain, i = [], "", 0
    names = sorted(added, key=len, reverse=True)
    while i < len(text):
        name = next((n for n in names if text.startswith(n, i)), None)
        if name is None:
            plain += text[i]
            i += 1
            continue
        if plain:
            parts.append(json.dumps(plain))
            plain = ""
        parts.append(f"<[{added[name]}]>")
        i += len(name)
    if plain:
        parts.append(json.dumps(plain))
    return " ".join(parts)


def _tool_calls_lark(spec: dict, compact: bool, added: dict[str, int]) -> str:
    """1 to max_calls calls in a tool parser's format, as Lark with llguidance's %json."""
    options = ', "whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "' if compact else ""
    rules = []
    for i, schema in enumerate(spec["schemas"]):
        body = json.dumps({**schema, "x-guidance": json.loads("{" + options.lstrip(", ") + "}")} if compact else schema)
        rules.append(f"call{i}: %json {body}")
    one = " | ".join(f"call{i}" for i in range(len(spec["schemas"])))
    prefix, suffix, sep = (_literal(spec[k], added) for k in ("prefix", "suffix", "separator"))
    item = f"{prefix} ({one}) {suffix}".strip()
    more = int(spec["max_calls"]) - 1
    tail = f" ({sep} {item}){{0,{more}}}" if more else ""
    return "\n".join([f"start: {item}{tail}", *rules])
