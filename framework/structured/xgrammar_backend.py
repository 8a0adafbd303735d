"""The xgrammar backend (the default, as in vLLM and SGLang): JSON schemas, regexes,
GBNF-style EBNF grammars and structural tags, compiled to token-mask automata."""

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
    choice_regex,
)


class XgrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(int(token_id)))

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


class XgrammarCompiled(CompiledGrammar):
    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled

    def matcher(self, max_rollback_tokens: int = 0) -> GrammarMatcher:
        import xgrammar as xgr

        return XgrammarMatcher(xgr.GrammarMatcher(self._compiled, max_rollback_tokens=max_rollback_tokens))


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"
    supported_kinds = frozenset({"json", "json_object", "regex", "choice", "grammar", "structural_tag", "tool_calls"})
    requires = ("xgrammar",)

    def __init__(self, vocab: VocabInfo) -> None:
        super().__init__(vocab)
        import xgrammar as xgr

        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(vocab.tokenizer_json)
        info = xgr.TokenizerInfo(list(vocab.encoded_vocab), metadata["vocab_type"], vocab_size=vocab.vocab_size,
                                 stop_token_ids=list(vocab.stop_token_ids), add_prefix_space=metadata["add_prefix_space"])
        # one compile thread: the engine runs compiles on its own worker threads
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    @classmethod
    def validate(cls, constraint: Constraint) -> None:
        super().validate(constraint)
        import xgrammar as xgr

        try:
            _grammar(xgr, constraint)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own types
            raise GrammarError(_message(exc)) from None

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        import xgrammar as xgr

        try:
            if constraint.kind == "structural_tag":
                compiled = self._compiler.compile_structural_tag(constraint.spec)
            else:
                compiled = self._compiler.compile_grammar(_grammar(xgr, constraint))
        except GrammarError:
            raise
        except Exception as exc:
            raise GrammarError(_message(exc)) from None
        return XgrammarCompiled(compiled)


def _grammar(xgr: Any, c: Constraint) -> Any:
    """The xgrammar Grammar of a constraint (parsing only: no vocabulary needed)."""
    if c.kind == "json":
        return xgr.Grammar.from_json_schema(c.spec, any_whitespace=not c.compact_json, strict_mode=True)
    if c.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not c.compact_json)
    if c.kind == "regex":
        return xgr.Grammar.from_regex(c.spec)
    if c.kind == "choice":
        return xgr.Grammar.from_regex(choice_regex(json.loads(c.spec)))
    if c.kind == "grammar":
        if c.grammar_syntax != "ebnf":
            raise GrammarError(f"the xgrammar backend reads GBNF/EBNF grammars, not {c.grammar_syntax!r}; "
                               "use the llguidance backend for Lark")
        return xgr.Grammar.from_ebnf(c.spec)
    if c.kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(c.spec)
    if c.kind == "tool_calls":
        spec = json.loads(c.spec)

        def literal(text: str):
            return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}") if text else None

        def joined(*parts):
            parts = [p for p in parts if p is not None]
            return parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts)

        calls = [xgr.Grammar.from_json_schema(json.dumps(s), any_whitespace=not c.compact_json) for s in spec["schemas"]]
        one = joined(literal(spec["prefix"]), calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls),
                     literal(spec["suffix"]))
        sep = literal(spec["separator"])
        # 1 to max_calls calls: a union of the fixed-length sequences (max_calls is small)
        options = [joined(*([one] + [g for _ in range(k) for g in (sep, one)])) for k in range(int(spec["max_calls"]))]
        return options[0] if len(options) == 1 else xgr.Grammar.union(*options)
    raise GrammarError(f"unknown constraint kind {c.kind!r}")


def _message(exc: BaseException) -> str:
    """The error's text without xgrammar's "[time] file.cc:line: " prefix."""
    import re

    lines = str(exc).strip().splitlines()
    text = lines[-1] if lines else type(exc).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)[:500]
