"""LLaVA (CLIP tower + Qwen2 language model) through the engine against transformers.

Reference: transformers' `LlavaForConditionalGeneration` and its `LlavaProcessor` (the
Pillow image processor) on the same random-weight checkpoint (`write_llava`), greedy,
float32. Ours: `LLM.generate` with `multi_modal_data`, in batches mixing images and
text, with prefill chunks that end inside an image, with preemption, and with the
prefix and encoder caches on.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from PIL import Image  # noqa: E402

from portaserve import LLM, SamplingParams  # noqa: E402

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = 151655
TOKENS_PER_IMAGE = 16  # 56x56 pixels in 14-pixel patches, class token dropped


def image(seed: int, size=(70, 90)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    from portaserve.models.checkpoints_vl import write_llava

    return str(write_llava(tmp_path_factory.mktemp("llava"), "tiny", seed=0))


@pytest.fixture(scope="module")
def llava_siglip(tmp_path_factory) -> str:
    from portaserve.models.checkpoints_vl import write_llava

    return str(write_llava(tmp_path_factory.mktemp("llava-siglip"), "tiny", seed=2, vision_tower="siglip"))


@functools.lru_cache(maxsize=2)
def hf_model(folder: str):
    model, info = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                                             output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval(), transformers.AutoProcessor.from_pretrained(folder, backend="pil")


def hf_greedy(folder: str, text: str, images: list, max_new_tokens: int) -> tuple[list[int], int]:
    model, processor = hf_model(folder)
    inputs = processor(images=images or None, text=text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    n = inputs["input_ids"].shape[1]
    return out[0, n:].tolist(), n


N = 24  # greedy tokens compared
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)

PROMPTS = [
    (f"Describe {PLACEHOLDER} please", [1]),
    (f"{PLACEHOLDER} and {PLACEHOLDER}: which is brighter?", [2, 3]),
    ("A prompt with no image at all, only words", []),
    (f"The same picture as before {PLACEHOLDER}", [1]),
]


def run(llm: LLM, prompts) -> list:
    inputs = [{"prompt": text, "multi_modal_data": {"image": [image(s) for s in seeds]}} if seeds else text
              for text, seeds in prompts]
    return llm.generate(inputs, GREEDY, use_tqdm=False)


def test_transformers_reference_sees_the_image(llava):
    """Control: the reference's output depends on the image, so matching it checks the tower."""
    a, _ = hf_greedy(llava, PROMPTS[0][0], [image(1)], N)
    b, _ = hf_greedy(llava, PROMPTS[0][0], [image(9)], N)
    assert a != b


@pytest.mark.parametrize("budget", [None, 7], ids=["whole-prompts", "chunks-inside-images"])
def test_greedy_matches_transformers_in_mixed_batches(llava, budget):
    kwargs = dict(max_num_batched_tokens=budget) if budget else {}
    llm = LLM(model=llava, dtype="float32", device="cpu", block_size=8, **kwargs)
    outs = run(llm, PROMPTS)
    for (text, seeds), out in zip(PROMPTS, outs):
        ref, ref_len = hf_greedy(llava, text, [image(s) for s in seeds], N)
        assert len(out.prompt_token_ids) == ref_len  # image tokens count in the prompt
        assert list(out.outputs[0].token_ids) == ref, (text, seeds)
    # the two requests showing image 1 were encoded once
    stats = llm.llm_engine.core.scheduler.encoder_cache
    assert stats.num_encoded == 3 and stats.num_hits >= 1


def test_siglip_tower_matches_transformers(llava_siglip):
    """SigLIP: no class token, a biased patch embedding, no pre-norm, the whole tower read
    ("full" strategy); its pooling head is in the checkpoint and skipped."""
    llm = LLM(model=llava_siglip, dtype="float32", device="cpu", block_size=8)
    outs = run(llm, PROMPTS[:2])
    for (text, seeds), out in zip(PROMPTS[:2], outs):
        ref, ref_len = hf_greedy(llava_siglip, text, [image(s) for s in seeds], N)
        assert len(out.prompt_token_ids) == ref_len
        assert list(out.outputs[0].token_ids) == ref


@pytest.mark.slow
def test_prefix_cache_never_shares_blocks_between_different_images(llava):
    """Identical placeholder tokens, different images: the second request must not reuse
    the first one's KV blocks (this fails if block hashes ignore the image)."""
    llm = LLM(model=llava, dtype="float32", device="cpu", block_size=8)
    text = f"{PLACEHOLDER} is a picture of something"
    first = run(llm, [(text, [4])])[0]
    second = run(llm, [(text, [5])])[0]
    again = run(llm, [(text, [5])])[0]
    ref5, _ = hf_greedy(llava, text, [image(5)], N)
    assert list(second.outputs[0].token_ids) == ref5 != list(first.outputs[0].token_ids)
    assert second.num_cached_tokens < TOKENS_PER_IMAGE  # at most the blocks before the image
    assert again.num_cached_tokens >= TOKENS_PER_IMAGE  # the same image does hit
    assert list(again.outputs[0].token_ids) == ref5


@pytest.mark.slow
def test_preemption_across_an_image_recomputes_it(llava):
    """A KV cache too small for every request at once: requests are preempted and resumed
    with their images re-read (from the encoder cache or encoded again)."""
    llm = LLM(model=llava, dtype="float32", device="cpu", block_size=8, num_gpu_blocks_override=12,
              max_num_batched_tokens=16)
    prompts = [(f"{PLACEHOLDER} number {i}", [10 + i]) for i in range(4)]
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": image(s[0])}} for t, s in prompts],
                        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    for (text, seeds), out in zip(prompts, outs):
        ref, _ = hf_greedy(llava, text, [image(s) for s in seeds], 24)
        assert list(out.outputs[0].token_ids) == ref


def test_image_errors_name_the_parameter(llava):
    from portaserve.framework.errors import InvalidParameterError

    llm = LLM(model=llava, dtype="float32", device="cpu", limit_mm_per_prompt={"image": 2})
    with pytest.raises(InvalidParameterError, match="placeholder") as info:
        llm.generate({"prompt": "no placeholder here", "multi_modal_data": {"image": image(1)}}, GREEDY)
    assert info.value.param == "multi_modal_data"
    with pytest.raises(InvalidParameterError, match="limit of 2"):
        llm.generate({"prompt": PLACEHOLDER * 3, "multi_modal_data": {"image": [image(1)] * 3}}, GREEDY)
    with pytest.raises(InvalidParameterError, match="PIL") as info:
        llm.generate({"prompt": PLACEHOLDER, "multi_modal_data": {"image": b"not an image"}}, GREEDY)
    assert info.value.param == "multi_modal_data.image[0]"
    with pytest.raises(InvalidParameterError, match="video"):
        llm.generate({"prompt": PLACEHOLDER, "multi_modal_data": {"video": [image(1)]}}, GREEDY)


def test_image_in_a_multi_turn_chat(llava):
    llm = LLM(model=llava, dtype="float32", device="cpu")
    conversation = [
        {"role": "system", "content": "You look at pictures."},
        {"role": "user", "content": [{"type": "image", "image": image(7)}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A noisy square."},
        {"role": "user", "content": "And its colors?"},
    ]
    out = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    from portaserve.framework.engine.chat import without_image_data

    text = llm.get_tokenizer().apply_chat_template(without_image_data(conversation))
    ref, ref_len = hf_greedy(llava, text, [image(7)], N)
    assert len(out.prompt_token_ids) == ref_len and list(out.outputs[0].token_ids) == ref


@pytest.mark.slow
def test_chat_with_image_parts_matches_the_prompt_form(llava):
    llm = LLM(model=llava, dtype="float32", device="cpu")
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": "data:,unused"}}]}]
    # LLM.chat takes PIL images in "image" parts, as vLLM's offline chat does
    messages[0]["content"][1] = {"type": "image", "image": image(6)}
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    text = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image"}]}])
    ref, _ = hf_greedy(llava, text, [image(6)], N)
    assert list(chat.outputs[0].token_ids) == ref
