"""How each `tokenizer.ggml.pre` type splits text before byte-level BPE.

A GGUF file with a `gpt2` (byte-level BPE) tokenizer stores its vocabulary and merges,
plus a name, `tokenizer.ggml.pre`, for the way the original tokenizer cut text into
words first. llama.cpp keeps a table from those names to regex lists (in
`src/llama-vocab.cpp`); the regexes are the pre-tokenizers of the models' own
tokenizer.json files. Each regex in a list splits every piece the previous ones left,
keeping both the matches and the text between them, which is what `tokenizers`'
`Split(..., behavior="isolated")` does, so the list becomes a `Sequence` of those.

Where llama.cpp rewrote a regex for its own regex engine (no `(?i:...)`, lookarounds
emulated), the table holds the original from tokenizer.json, which `tokenizers`
(Oniguruma) runs as written. The per-type flags llama.cpp sets are kept too:
`ignore_merges` (a word that is itself a token is emitted whole) and whether a BOS is
added by default.

Types llama.cpp handles with custom code rather than regexes are listed in
`UNSUPPORTED` and refused by name, never approximated.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PreTokenizerSpec:
    """The split regexes of one pre-tokenizer type and llama.cpp's flags for it."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


# ----- the regexes ------------------------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_JAIS2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
    r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)
# Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee and other cased letters of
# DeepSeek-LLM's tokenizer.json, as one class.
_DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-"
    "\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-"
    "\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20"
    "-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc"
    "\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6"
    "-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-"
    "\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-"
    "\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-"
    "\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-"
    "\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-"
    "\U000118df\U0001e900-\U0001e943"
)
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK3_MAIN = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CASED_WORDS = (  # GPT-4o's word rule: an optional capitalized run then lowercase, or all-caps
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{c}"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{c}"
)
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (
    _CASED_WORDS.replace("{c}", _CONTRACTION)
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = _CASED_WORDS.replace("{c}", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GRANITE_EMB_MULTI = (  # GPT-4o's rule with combining marks kept on their letters
    r"[^\r\n\p{L}\p{N}]?(?:(?=[\p{L}\p{M}])[^a-z])*(?:(?=[\p{L}\p{M}])[^A-Z])+" + _CONTRACTION
    + r"|[^\r\n\p{L}\p{N}]?(?:(?=[\p{L}\p{M}])[^a-z])+(?:(?=[\p{L}\p{M}])[^A-Z])*" + _CONTRACTION
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_NORDIC = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

_SPECS: dict[str, PreTokenizerSpec] = {
    "default": PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "llama3": PreTokenizerSpec((_LLAMA3,), ignore_merges=True, add_bos=True),
    "jais-2": PreTokenizerSpec((_JAIS2,)),
    "dbrx": PreTokenizerSpec((_LLAMA3,)),
    "deepseek-llm": PreTokenizerSpec((
        r"[\r\n]",
        r"\s?[" + _DEEPSEEK_LETTERS + r"]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        _CJK_HANGUL,
        r"\p{N}+",
    )),
    "deepseek-v3": PreTokenizerSpec((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3_MAIN)),
    "spark2_5": PreTokenizerSpec((
        r"\p{N}{1,3}",
        _CJK_KANA,
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+"
        r"|[\r\n]|\s+(?!\S)|\s+",
        r"\p{N}",
    )),
    "youtu": PreTokenizerSpec((
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _CJK_KANA,
        _CASED_WORDS.replace("{c}", _CONTRACTION) + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ), ignore_merges=True),
    "deepseek-coder": PreTokenizerSpec((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")),
    "falcon": PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    "starcoder": PreTokenizerSpec((r"\p{N}", _GPT2)),
    "gpt-2": PreTokenizerSpec((_GPT2,)),
    "qwen2": PreTokenizerSpec((_QWEN2,)),
    "qwen35": PreTokenizerSpec((_QWEN35,)),
    "poro-chat": PreTokenizerSpec((_NORDIC,)),
    "chatglm-bpe": PreTokenizerSpec((_LLAMA3,)),
    "glm4": PreTokenizerSpec((_LLAMA3,), ignore_merges=True),
    "viking": PreTokenizerSpec((_NORDIC, r"\p{N}")),
    "tekken": PreTokenizerSpec((_TEKKEN,), ignore_merges=True, add_bos=True),
    "chameleon": PreTokenizerSpec((
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _GPT2,
    ), add_bos=True),
    "gpt-4o": PreTokenizerSpec((_GPT4O,)),
    "granite-embed-multi-97m": PreTokenizerSpec((_GRANITE_EMB_MULTI,), ignore_merges=True),
    "tiny_aya": PreTokenizerSpec((r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O)),
    "bailingmoe": PreTokenizerSpec((
        r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    )),
    "seed-coder": PreTokenizerSpec((
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    )),
    "ufakzeka": PreTokenizerSpec((
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    )),
    "laguna": PreTokenizerSpec((r"[^\n]+|[\n]+", _QWEN2)),
    "exaone-moe": PreTokenizerSpec((
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
    )),
    "minicpm5": PreTokenizerSpec((
        r"\p{N}{1,3}",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
    ), ignore_merges=True),
}

#: Every name llama.cpp accepts, mapped onto the entry whose regexes it uses (the flags
#: llama.cpp sets per name are in the entries: glm4 merges-ignoring, chatglm-bpe not).
ALIASES: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
        "llama3",
    ),
    "jais-2": "jais-2",
    **dict.fromkeys(("dbrx", "smaug-bpe"), "dbrx"),
    "deepseek-llm": "deepseek-llm",
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), "deepseek-v3"),
    "spark2_5": "spark2_5",
    "youtu": "youtu",
    "deepseek-coder": "deepseek-coder",
    "falcon": "falcon",
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"), "starcoder"
    ),
    **dict.fromkeys(
        ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
         "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "jina-v1-en",
         "jina-v2-code", "roberta-bpe"),
        "gpt-2",
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"),
        "qwen2",
    ),
    "qwen35": "qwen35",
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), "poro-chat"),
    "chatglm-bpe": "chatglm-bpe",
    **dict.fromkeys(("glm4", "glm5"), "glm4"),
    "viking": "viking",
    "tekken": "tekken",
    "chameleon": "chameleon",
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), "gpt-4o"),
    "granite-embed-multi-97m": "granite-embed-multi-97m",
    **dict.fromkeys(("tiny_aya", "cohere2moe"), "tiny_aya"),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), "bailingmoe"),
    "seed-coder": "seed-coder",
    "ufakzeka": "ufakzeka",
    "laguna": "laguna",
    "exaone-moe": "exaone-moe",
    "minicpm5": "minicpm5",
}

#: Types llama.cpp tokenizes with custom code (not a regex list) or without byte-level
#: encoding; portaserve refuses them by name.
UNSUPPORTED: dict[str, str] = {
    "kimi-k2": "a custom Han-script splitter in llama.cpp's unicode.cpp",
    "afmoe": "a custom digit grouping in llama.cpp's unicode.cpp",
    "superbpe": "a zero-width digit-grouping split",
    "gemma4": "SentencePiece-style BPE on raw UTF-8 (not byte-level)",
    "granite-embed-multi-311m": "SentencePiece-style BPE on raw UTF-8 (not byte-level)",
    "sarvam-moe": "SentencePiece-style BPE on raw UTF-8 (not byte-level)",
    "whitespace": "a whitespace split without byte-level encoding",
}


def pretokenizer_spec(name: str) -> PreTokenizerSpec:
    """The spec for `tokenizer.ggml.pre` = `name` (a missing value means "default", as in llama.cpp).

    :raises KeyError: with a message naming the type and saying why it is not supported.
    """
    key = ALIASES.get(name)
    if key is not None:
        return _SPECS[key]
    if name in UNSUPPORTED:
        raise KeyError(f"pre-tokenizer type {name!r} is not supported: llama.cpp implements it with {UNSUPPORTED[name]}")
    raise KeyError(f"pre-tokenizer type {name!r} is unknown; supported: {', '.join(sorted(ALIASES))}")
