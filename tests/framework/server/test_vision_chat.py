"""Images in /v1/chat/completions, through the official openai client, on a tiny LLaVA.

The reference for the output is transformers' LlavaForConditionalGeneration fed by its
own LlavaProcessor (Pillow) with the same image and the same rendered prompt; usage
counts the image's tokens. Bad image input is a 400 in OpenAI's error shape naming the
content part; fetching a URL of a domain not allowed, or a local file outside the
allowed folder, is refused.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch

from portaserve.framework.config import EngineConfig
from portaserve.framework.server.state import ServerSettings
from server_harness import ServerThread

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a server

from PIL import Image  # noqa: E402


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8))


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from portaserve.models.checkpoints_vl import write_llava

    return str(write_llava(tmp_path_factory.mktemp("llava-srv"), "tiny", seed=1))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    picture(3).save(folder / "ok.png")
    return folder


@pytest.fixture(scope="module")
def srv(llava, media_dir):
    settings = ServerSettings(allowed_local_media_path=str(media_dir))
    config = EngineConfig.create(model=llava, served_model_name="llava", dtype="float32", limit_mm_per_prompt={"image": 2})
    with ServerThread(config, settings) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def image_part(url: str, detail: str | None = None) -> dict:
    body = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": body}


def reference(folder: str, text: str, images: list, max_new_tokens: int) -> tuple[list[int], int]:
    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    processor = transformers.AutoProcessor.from_pretrained(folder, backend="pil")
    inputs = processor(images=images, text=text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist(), inputs["input_ids"].shape[1]


def test_data_url_image_matches_transformers_and_the_python_api(client, srv, llava):
    messages = user({"type": "text", "text": "What is in the picture?"}, image_part(data_url(picture(7)), "high"))
    resp = client.chat.completions.create(model="llava", messages=messages, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True, "logprobs": False})
    tokenizer = srv.engine.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "What is in the picture?"}, {"type": "image"}]}])
    ref, ref_prompt = reference(llava, text, [picture(7)], 24)
    assert tokenizer.decode(ref) == resp.choices[0].message.content
    assert resp.usage.prompt_tokens == ref_prompt  # the image's 16 tokens are counted
    from portaserve import LLM, SamplingParams

    llm = LLM(model=llava, dtype="float32", device="cpu")
    offline = llm.chat(user({"type": "text", "text": "What is in the picture?"}, {"type": "image", "image": picture(7)}),
                       SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert offline.outputs[0].text == resp.choices[0].message.content


def test_models_say_images_and_a_repeated_image_hits_the_encoder_cache(client, srv):
    card = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]
    assert card["input_modalities"] == ["text", "image"]

    def hits() -> float:
        text = httpx.get(srv.url + "/metrics", timeout=30).text
        line = next(x for x in text.splitlines() if x.startswith("portaserve:encoder_cache_hits_total"))
        return float(line.split()[-1])

    url = data_url(picture(42))
    client.chat.completions.create(model="llava", messages=user(image_part(url)), max_tokens=1)
    before = hits()
    client.chat.completions.create(model="llava", messages=user({"type": "text", "text": "again"}, image_part(url)),
                                   max_tokens=1)
    assert hits() == before + 1


def test_jpeg_webp_and_local_files_load(client, media_dir):
    for url in (data_url(picture(8), "JPEG"), data_url(picture(8), "WEBP"), (media_dir / "ok.png").as_uri()):
        resp = client.chat.completions.create(model="llava", messages=user(image_part(url)), max_tokens=2)
        assert resp.choices[0].finish_reason in ("length", "stop")


def test_streaming_with_an_image(client):
    stream = client.chat.completions.create(model="llava", messages=user(image_part(data_url(picture(9)))), max_tokens=4,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens > 16


def huge_png() -> str:
    """A valid small PNG whose header claims 100000 x 100000 pixels (a decompression bomb)."""
    import struct
    import zlib

    buf = io.BytesIO()
    picture(1).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = struct.pack(">II", 100_000, 100_000)  # IHDR width, height
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return "data:image/png;base64," + base64.b64encode(bytes(data)).decode()


@pytest.mark.parametrize("part, where, reason", [
    (image_part("data:image/png;base64,bm90IGFuIGltYWdl"), "messages[0].content[1]", "image"),
    (image_part(huge_png()), "messages[0].content[1]", "pixels"),
    (image_part("http://127.0.0.1/cat.png"), "messages[0].content[1]", "allowed"),
    (image_part("http://169.254.169.254/latest/meta-data"), "messages[0].content[1]", "allowed"),
    (image_part("https://example.com/cat.png"), "messages[0].content[1]", "allowed"),
    (image_part("file:///etc/passwd"), "messages[0].content[1]", "allowed"),
    ({"type": "image_url", "image_url": {}}, "messages[0].content[1].image_url.url", "non-empty"),
])
def test_bad_images_are_400s_naming_the_part(srv, part, where, reason):
    body = {"model": "llava", "max_tokens": 2, "messages": user({"type": "text", "text": "hi"}, part)}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and where in err["message"] and reason in err["message"], err


def test_too_many_images_and_oversized_prompts_are_refused(srv):
    three = [image_part(data_url(picture(i))) for i in range(3)]
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "llava", "messages": user(*three)}, timeout=60)
    assert r.status_code == 400 and "limit of 2" in r.json()["error"]["message"]
    # the server keeps serving after every refusal
    ok = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                    json={"model": "llava", "max_tokens": 2, "messages": user(image_part(data_url(picture(1))))})
    assert ok.status_code == 200


@pytest.fixture(scope="module")
def allowlisted(llava):
    """A server that allowlists the loopback and metadata addresses by name: still refused."""
    settings = ServerSettings(allowed_media_domains=("127.0.0.1", "169.254.169.254", "localhost"))
    with ServerThread(EngineConfig.create(model=llava, served_model_name="llava", dtype="float32"), settings) as server:
        yield server


@pytest.mark.parametrize("url", ["http://127.0.0.1/cat.png", "http://169.254.169.254/latest/meta-data",
                                 "http://localhost:8000/v1/models"])
def test_private_addresses_are_refused_even_when_allowlisted(allowlisted, url):
    body = {"model": "llava", "max_tokens": 2, "messages": user(image_part(url))}
    r = httpx.post(allowlisted.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "messages[0].content[0]" in err["message"] and ("private" in err["message"] or "loopback" in err["message"]
                                                           or "public" in err["message"]), err


def test_images_through_the_messages_and_responses_apis(client, srv):
    """An image block (Messages API, anthropic client) and an input_image part (Responses
    API) reach the same model input as a chat image_url part: the same greedy text."""
    import anthropic

    image = picture(11)
    url = data_url(image)
    chat = client.chat.completions.create(
        model="llava", max_tokens=16, temperature=0,
        messages=user({"type": "text", "text": "Describe it."}, image_part(url)))
    response = client.responses.create(model="llava", max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Describe it."},
                                     {"type": "input_image", "image_url": url}]}])
    b64 = url.split(",", 1)[1]
    message = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0).messages.create(
        model="llava", max_tokens=16, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Describe it."},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}])
    text = chat.choices[0].message.content
    assert response.output_text == text and message.content[0].text == text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
