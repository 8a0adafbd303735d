"""A GGUF file's tokenizer as a `tokenizers.Tokenizer`, built from its metadata.

llama.cpp's converter stores the vocabulary as `tokenizer.ggml.*` arrays; the model
type says which algorithm to rebuild:

- `gpt2`: byte-level BPE. Tokens are already in the byte-level alphabet and the merges
  are stored; the split before BPE comes from `tokenizer.ggml.pre` (see
  `pretokenizers.py`).
- `llama`: SentencePiece BPE with scores. The merges are not stored: every way of
  cutting a token into two tokens is a merge, ranked by the whole token's score (the
  pair SentencePiece joins first is the one whose result scores highest). Spaces become
  `▁`, a `▁` is prepended to each run of text (llama.cpp does so after every special
  token too, like transformers' legacy Llama tokenizer), and characters outside the
  vocabulary fall back to the `<0xXX>` byte tokens.
- `bert`: WordPiece. The converter rewrote the vocabulary with a "phantom space": a
  token that starts a word carries `▁`, a continuation lost its `##`. Both are undone.

Token types: CONTROL tokens are special added tokens (`skip_special_tokens` drops them),
USER_DEFINED tokens are added tokens matched verbatim in text and kept when decoding;
UNUSED and BYTE tokens are ordinary vocabulary entries.

End-of-generation ids: the eos, eot and eom ids, plus the control tokens llama.cpp
treats as end-of-generation by their text (`<|im_end|>`, `<|eot_id|>`, ...), since a
GGUF file has no generation_config.json listing them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from portaserve.framework.errors import invalid

from .file import GGUFFile
from .pretokenizers import pretokenizer_spec

# llama_token_type in llama.cpp (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

#: Control tokens llama.cpp ends generation on, by their text (a subset of its list:
#: the ones of the architectures portaserve serves).
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
    "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
})

SUPPORTED_MODELS = ("gpt2", "llama", "bert")


@dataclass
class GGUFTokenizerParts:
    """What `Tokenizer.__init__` needs, read from a GGUF file."""

    backend: Any
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    extra_special_ids: list[int] = field(default_factory=list)
    generation_eos_ids: list[int] = field(default_factory=list)
    model_max_length: int | None = None


def gguf_tokenizer(gguf: GGUFFile) -> GGUFTokenizerParts:
    """Build the tokenizer of a GGUF file (a vocab-only file works too).

    :raises InvalidParameterError: (param `tokenizer`) no vocabulary, an unsupported
        tokenizer model or pre-tokenizer type; the message names the file and the
        supported values.
    """
    model = gguf.get("tokenizer.ggml.model")
    tokens = gguf.get_array("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise invalid("tokenizer", f"{gguf.path} has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
    types = list(gguf.get_array("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise invalid("tokenizer", f"{gguf.path}: {len(types)} token types for {len(tokens)} tokens")
    add_bos_default = True  # SentencePiece; WordPiece adds [CLS] through its post-processor
    if model == "gpt2":
        backend, add_bos_default = _byte_level_bpe(gguf, tokens, types)
    elif model == "llama":
        backend = _sentencepiece_bpe(gguf, tokens, types)
    elif model == "bert":
        backend = _wordpiece(gguf, tokens, types)
    else:
        raise invalid(
            "tokenizer",
            f"{gguf.path}: tokenizer model {model!r} is not supported; supported: {', '.join(SUPPORTED_MODELS)}",
        )
    _add_special_tokens(backend, tokens, types)

    def token_of(key: str) -> str | None:
        value = gguf.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(value)] if value is not None and 0 <= int(value) < len(tokens) else None

    eog: set[int] = set()
    for key in ("eos", "eot", "eom"):
        value = gguf.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            eog.add(int(value))
    eog.update(i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == CONTROL and t in END_OF_GENERATION_TEXTS)
    if model == "bert":
        add_bos = add_eos = None  # [CLS] text [SEP]: the post-processor adds both
    else:
        add_bos = gguf.get("tokenizer.ggml.add_bos_token")
        add_bos = add_bos_default if add_bos is None else bool(add_bos)
        add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False))
    context = gguf.arch_key("context_length") if gguf.has("general.architecture") else None
    return GGUFTokenizerParts(
        backend=backend,
        chat_template=gguf.get("tokenizer.chat_template"),
        bos_token=token_of("bos"),
        eos_token=token_of("seperator") or token_of("eos") if model == "bert" else token_of("eos"),
        pad_token=token_of("padding"),
        unk_token=token_of("unknown"),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        extra_special_ids=[i for i, kind in enumerate(types) if kind == CONTROL],
        generation_eos_ids=sorted(eog),
        model_max_length=int(context) if context else None,
    )


def _vocab(tokens) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        # a duplicated string (rare padding entries) keeps its first id, as llama.cpp's lookup does
        vocab.setdefault(token, i)
    return vocab


def _add_special_tokens(backend, tokens, types) -> None:
    """CONTROL tokens as special added tokens, USER_DEFINED ones as plain added tokens."""
    from tokenizers import AddedToken

    added = []
    for token, kind in zip(tokens, types):
        if kind == CONTROL and token:
            added.append(AddedToken(token, special=True, normalized=False))
        elif kind == USER_DEFINED and token:
            added.append(AddedToken(token, special=False, normalized=False))
    if added:
        backend.add_tokens(added)


def _byte_level_bpe(gguf: GGUFFile, tokens, types):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges_raw = gguf.get_array("tokenizer.ggml.merges")
    if merges_raw is None:
        raise invalid("tokenizer", f"{gguf.path}: a gpt2 (byte-level BPE) tokenizer without tokenizer.ggml.merges")
    pre = gguf.get("tokenizer.ggml.pre") or "default"
    try:
        spec = pretokenizer_spec(str(pre))
    except KeyError as exc:
        raise invalid("tokenizer", f"{gguf.path}: {exc.args[0]}") from None
    merges = []
    for line in merges_raw:
        left, sep, right = line.partition(" ")
        if not sep:
            raise invalid("tokenizer", f"{gguf.path}: merge {line!r} is not two tokens separated by a space")
        merges.append((left, right))
    model = models.BPE(_vocab(tokens), merges, ignore_merges=spec.ignore_merges)
    tokenizer = Tokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, spec.add_bos


def _sentencepiece_merges(tokens, scores, types) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a token, best-scoring result first."""
    vocab = {}
    for i, token in enumerate(tokens):
        if types[i] in (NORMAL, USER_DEFINED, UNUSED):
            vocab.setdefault(token, i)
    ranked = []
    for token, i in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                # ties between merges of equal score go to the lower token ids, like transformers' extractor
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(gguf: GGUFFile, tokens, types):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers

    scores = gguf.get_array("tokenizer.ggml.scores")
    if scores is None:
        scores = [0.0] * len(tokens)
    unk_id = gguf.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    model = models.BPE(
        _vocab(tokens), _sentencepiece_merges(tokens, scores, types), unk_token=unk, fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    add_prefix = gguf.get("tokenizer.ggml.add_space_prefix")
    add_prefix = True if add_prefix is None else bool(add_prefix)
    # A ▁ before every run of text, even one that starts with a space and after special
    # tokens (llama.cpp's is_prev_special; transformers' legacy Llama tokenizer): a
    # normalizer, since Metaspace's "always" skips text that already starts with ▁.
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    steps.append(normalizers.Replace(" ", "▁"))
    if gguf.get("tokenizer.ggml.remove_extra_whitespaces"):
        steps = [normalizers.Strip(), normalizers.Replace(Regex(r"\s+"), " ")] + steps
    tokenizer.normalizer = normalizers.Sequence(steps)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _wordpiece(gguf: GGUFFile, tokens, types):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind == CONTROL:
            original = token
        elif token.startswith("▁"):
            original = token[1:]
        else:
            original = "##" + token
        vocab.setdefault(original, i)
    unk_id = gguf.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else "[UNK]"
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    lowercase = gguf.get("tokenizer.ggml.normalizer.lowercase")
    lowercase = True if lowercase is None else bool(lowercase)
    strip_accents = gguf.get("tokenizer.ggml.normalizer.strip_accents")
    strip_accents = lowercase if strip_accents is None else bool(strip_accents)
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip_accents, lowercase=lowercase
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    cls_id = gguf.get("tokenizer.ggml.cls_token_id", gguf.get("tokenizer.ggml.bos_token_id"))
    sep_id = gguf.get("tokenizer.ggml.seperator_token_id", gguf.get("tokenizer.ggml.eos_token_id"))
    if cls_id is not None and sep_id is not None:
        cls, sep = tokens[int(cls_id)], tokens[int(sep_id)]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, int(cls_id)), (sep, int(sep_id))],
        )
    return tokenizer
