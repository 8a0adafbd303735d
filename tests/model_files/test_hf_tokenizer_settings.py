"""HF tokenizer folders behave as transformers makes them behave, on real vocabularies.

- all-MiniLM-L6-v2's tokenizer.json carries `padding: Fixed 128` and `truncation: 128`
  (training-time settings): ignored, as transformers does, so long inputs keep every token;
- folders transformers itself writes for real vocabularies (llama.cpp's test vocabularies:
  Llama's SentencePiece, GPT-2's and Qwen2's byte-level BPE), under the tokenizer_config
  settings transformers' tokenizer classes read (`tokenizer_class`, `legacy`,
  `add_prefix_space`, `clean_up_tokenization_spaces`): the same ids and texts as
  `AutoTokenizer` on the same folder.
"""

from __future__ import annotations

import json

import pytest

from portaserve.framework.engine.tokenizer import Tokenizer

TEXTS = ["Hello world", " Hello  world", "hi<s>there", "Don't stop . , ! ?", "<s> x", "a\n\nb", " ", "naïve café 你好",
         "(x) [y] {z} 'q' \"r\" it's"]


def test_minilm_ignores_its_files_padding_and_truncation(minilm_folder):
    from transformers import AutoTokenizer

    spec = json.loads((minilm_folder / "tokenizer.json").read_text())
    assert spec["padding"] and spec["truncation"]["max_length"] == 128  # what the file says
    ours = Tokenizer.from_pretrained(minilm_folder)
    theirs = AutoTokenizer.from_pretrained(minilm_folder)
    long = "Embeddings map text to vectors, one sentence at a time. " * 20
    for text in TEXTS + [long]:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        # clean_up_tokenization_spaces: BERT's decoder joins punctuation as transformers does
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert len(ours.encode(long)) > 200


@pytest.fixture(scope="module")
def written_by_transformers(llama_cpp, tmp_path_factory):
    """Folders transformers writes (save_pretrained) for llama.cpp's real test vocabularies."""
    from transformers import AutoTokenizer

    folders = {}
    for name in ("llama-spm", "gpt-2", "qwen2"):
        vocab = llama_cpp.source / "models" / f"ggml-vocab-{name}.gguf"
        folder = tmp_path_factory.mktemp(name)
        AutoTokenizer.from_pretrained(vocab.parent, gguf_file=vocab.name).save_pretrained(folder)
        folders[name] = folder
    return folders


CASES = [
    ("llama-spm", {"tokenizer_class": "LlamaTokenizer"}),
    ("llama-spm", {"tokenizer_class": "LlamaTokenizer", "legacy": True}),
    ("llama-spm", {"tokenizer_class": "LlamaTokenizerFast", "legacy": False, "add_prefix_space": False}),
    ("llama-spm", {"tokenizer_class": "PreTrainedTokenizerFast", "legacy": True}),
    ("gpt-2", {"tokenizer_class": "GPT2TokenizerFast", "add_prefix_space": True}),
    ("gpt-2", {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "clean_up_tokenization_spaces": True}),
    ("gpt-2", {"tokenizer_class": "PreTrainedTokenizerFast", "add_prefix_space": True}),
    ("qwen2", {"tokenizer_class": "Qwen2Tokenizer", "add_prefix_space": True}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("vocab", "settings"), CASES, ids=[f"{v}-{i}" for i, (v, _) in enumerate(CASES)])
def test_tokenizer_config_settings_act_as_in_transformers(written_by_transformers, vocab, settings, tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    for file in written_by_transformers[vocab].iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **settings}))
    ours = Tokenizer.from_pretrained(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        ids = theirs(text).input_ids
        assert ours.encode(text) == ids, (text, theirs.convert_ids_to_tokens(ids))
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
