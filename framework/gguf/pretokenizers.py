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
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼ"
    "ℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
_CJK_HANGUL = "[一-龥ࠀ-一가-퟿]+"
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
_NORDIC = r" ?[^(\s|.,!?…。，、।۔،)]+"

_SPECS: dict[str, PreTokenizerSpec] = {
    "default": PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "llama3": PreTokenizerSpec((_LLAMA3,), ignore_merges=True, add_bos=True),
    "jais-2": PreTokenizerSpec((_JAIS2,)),
    "dbrx": PreTokenizerSpec((_LLAMA3,)),
    "deepseek-llm": PreTokenizerSpec((
        r"[\r\n]",
        r"\s?[" + _DEEPSEEK_LETTERS + r"]+",
        r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
        r"\s+$",
        _CJK_HANGUL,
        r"\p{N}+",
    )),
    "deepseek-v3": PreTokenizerSpec((r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", _DEEPSEEK3_MAIN)),
    "spark2_5": PreTokenizerSpec((
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+"
        r"|[\r\n]|\s+(?!\S)|\s+",
        r"\p{N}",
    )),
    "youtu": PreTokenizerSpec((
        r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
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
