"""/v1/embeddings on a tiny random BERT (sentence-transformers mean pooling + normalize),
against transformers' BertModel with the same pooling."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest

from portaserve.framework.config import EngineConfig
from server_harness import ServerThread

TEXTS = ["hello world", "a somewhat longer sentence about embeddings"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from portaserve.models.checkpoints import write_checkpoint

    return write_checkpoint("BertModel", "tiny", tmp_path_factory.mktemp("bert"), pooling="mean", normalize=True)


@pytest.fixture(scope="module")
def srv(ckpt):
    with ServerThread(EngineConfig.create(model=str(ckpt), served_model_name="bert")) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference(ckpt, ids):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.BertModel.from_pretrained(str(ckpt), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden.mean(0), dim=-1).tolist()


def test_embeddings_match_transformers(client, srv, ckpt):
    r = client.embeddings.create(model="bert", input=TEXTS)
    assert [d.index for d in r.data] == [0, 1]
    total = 0
    for text, d in zip(TEXTS, r.data):
        ids = httpx.post(srv.url + "/tokenize", json={"prompt": text}).json()["tokens"]
        total += len(ids)
        assert d.embedding == pytest.approx(reference(ckpt, ids), abs=1e-4)
        assert sum(x * x for x in d.embedding) == pytest.approx(1.0, abs=1e-4)
    assert r.usage.prompt_tokens == total == r.usage.total_tokens


def test_token_ids_base64_and_dimensions(client, srv):
    ids = httpx.post(srv.url + "/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    as_float = client.embeddings.create(model="bert", input=ids).data[0].embedding
    raw = httpx.post(srv.url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(as_float, abs=1e-6)
    short = client.embeddings.create(model="bert", input=TEXTS[0], dimensions=16).data[0].embedding
    assert len(short) == 16
    norm = sum(x * x for x in as_float[:16]) ** 0.5
    assert short == pytest.approx([x / norm for x in as_float[:16]], abs=1e-5)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="bert", input=TEXTS[0], dimensions=1000)


def test_generation_routes_are_400_on_an_embedding_model(client):
    with pytest.raises(openai.BadRequestError, match="embedding"):
        client.completions.create(model="bert", prompt="hi", max_tokens=2)


@pytest.mark.slow
def test_minilm_embeddings_match_sentence_transformers(minilm_folder):
    """A real sentence-transformers folder through /v1/embeddings and the official client."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    texts = ["A man is eating food.", "Sentence about topic number seven and what it says. " * 16]
    with ServerThread(EngineConfig.create(model=str(minilm_folder), served_model_name="minilm")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        data = client.embeddings.create(model="minilm", input=texts).data
        ids = httpx.post(server.url + "/tokenize", json={"prompt": texts[1]}).json()["tokens"]
        too_long = httpx.post(server.url + "/v1/embeddings", json={"model": "minilm", "input": "word " * 300})
    assert len(ids) > 128  # past the tokenizer.json's own padding / truncation length
    theirs = SentenceTransformer(str(minilm_folder), device="cpu").encode(texts)
    for ours, ref in zip((d.embedding for d in data), theirs):
        cosine = float(np.dot(ours, ref) / np.linalg.norm(ours) / np.linalg.norm(ref))
        assert cosine >= 0.9999, cosine
    assert too_long.status_code == 400 and "256" in too_long.json()["error"]["message"]
