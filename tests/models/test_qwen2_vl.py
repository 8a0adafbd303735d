"""Qwen2-VL and Qwen2.5-VL through the engine against transformers.

Reference: transformers' `Qwen2VLForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration`
on the same random-weight checkpoints (`write_qwen2_vl`, `write_qwen2_5_vl`), fed by its
Pillow image processor, greedy, float32; its `get_rope_index` and window index for the
multimodal positions and the windows. Images of two sizes (a 4 x 6 and an 8 x 12 patch
grid: Qwen2.5-VL's 2 x 2-token windows then include partial ones).
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
VARIANTS = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def image(seed: int, size=(120, 160)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def qwen_vl(request, tmp_path_factory) -> str:
    from portaserve.models.checkpoints_vl import write_qwen_vl

    return str(write_qwen_vl(tmp_path_factory.mktemp(request.param), "tiny", seed=3, variant=request.param))


@functools.lru_cache(maxsize=2)
def hf(folder: str):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    arch = transformers.AutoConfig.from_pretrained(folder).architectures[0]
    model, info = getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    return model.eval(), Qwen2VLImageProcessorPil.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)


def hf_inputs(folder: str, text: str, images: list):
    """input_ids with each placeholder expanded to its image's tokens, as Qwen2VLProcessor does."""
    _, processor, tokenizer = hf(folder)
    feats = processor(images, return_tensors="pt") if images else {}
    pieces = text.split("<|image_pad|>")
    counts = [int(g.prod()) // 4 for g in feats["image_grid_thw"]] if images else []
    expanded = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:]))
    ids = torch.tensor([tokenizer.encode(expanded)])
    extra = dict(pixel_values=feats["pixel_values"], image_grid_thw=feats["image_grid_thw"]) if images else {}
    return ids, extra


def hf_greedy(folder: str, text: str, images: list, max_new_tokens: int) -> list[int]:
    model = hf(folder)[0]
    ids, extra = hf_inputs(folder, text, images)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == IMAGE_PAD).int(),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
    return out[0, ids.shape[1]:].tolist()


PROMPTS = [
    (f"Describe {PLACEHOLDER} and {PLACEHOLDER} please", [(1, (120, 160)), (2, (70, 90))]),
    ("Only words in this one, no picture", []),
    (f"{PLACEHOLDER}", [(3, (70, 90))]),
]
N = 24  # greedy tokens compared
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("budget", [None, 9], ids=["whole-prompts", "chunks-inside-images"])
def test_greedy_matches_transformers_in_mixed_batches(qwen_vl, budget):
    kwargs = dict(max_num_batched_tokens=budget) if budget else {}
    llm = LLM(model=qwen_vl, dtype="float32", device="cpu", block_size=8, **kwargs)
    inputs = [{"prompt": t, "multi_modal_data": {"image": [image(s, size) for s, size in imgs]}} if imgs else t
              for t, imgs in PROMPTS]
    for (text, imgs), out in zip(PROMPTS, llm.generate(inputs, GREEDY, use_tqdm=False)):
        images = [image(s, size) for s, size in imgs]
        ids, _ = hf_inputs(qwen_vl, text, images)
        assert list(out.prompt_token_ids) == ids[0].tolist()
        assert list(out.outputs[0].token_ids) == hf_greedy(qwen_vl, text, images, N), text


def test_image_in_a_multi_turn_chat(qwen_vl):
    from portaserve.framework.engine.chat import without_image_data

    llm = LLM(model=qwen_vl, dtype="float32", device="cpu")
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": image(8, (70, 90))}]},
        {"role": "assistant", "content": "I see noise."},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image", "image": image(9)}]},
    ]
    out = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    text = llm.get_tokenizer().apply_chat_template(without_image_data(conversation))
    images = [image(8, (70, 90)), image(9)]
    assert list(out.prompt_token_ids) == hf_inputs(qwen_vl, text, images)[0][0].tolist()
    assert list(out.outputs[0].token_ids) == hf_greedy(qwen_vl, text, images, N)


def test_multimodal_rope_positions_match_get_rope_index(qwen_vl):
    from portaserve.models.qwen2_vl import rope_positions_for
    from portaserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
    from portaserve.framework.checkpoint import load_hf_config

    model = hf(qwen_vl)[0]
    text, imgs = PROMPTS[0]
    images = [image(s, size) for s, size in imgs]
    ids, extra = hf_inputs(qwen_vl, text, images)
    ref, delta = model.model.get_rope_index(ids, (ids == IMAGE_PAD).int(), image_grid_thw=extra["image_grid_thw"])
    mm = Qwen2VLForConditionalGeneration.multimodal_processor(load_hf_config(qwen_vl), qwen_vl)
    expanded, features = mm.expand(hf(qwen_vl)[2].encode(text), images)
    assert expanded == ids[0].tolist()
    ours, shift = rope_positions_for(len(expanded), features, 2)
    assert np.array_equal(ours, ref[:, 0].numpy()) and shift == int(delta[0])
    assert not np.array_equal(ours[1], ours[2])  # the image tokens' rows and columns differ: a real 3-D case


def test_window_order_matches_transformers():
    from transformers.vision_utils import get_vision_window_index

    from portaserve.models.qwen2_vl import window_order

    grids = [(1, 8, 12), (1, 4, 6), (1, 6, 4)]
    order, lengths = window_order(grids, merge=2, window=56, patch=14)
    ref_order, ref_cu = get_vision_window_index(torch.tensor(grids), spatial_merge_size=2, window_size=56, patch_size=14)
    assert torch.equal(order, ref_order)
    assert [0, *np.cumsum(lengths).tolist()] == ref_cu.tolist()


@pytest.mark.slow
def test_prefix_cache_and_encoder_cache_with_images(qwen_vl):
    llm = LLM(model=qwen_vl, dtype="float32", device="cpu", block_size=8)
    text = f"{PLACEHOLDER} tell me about it"
    outs = []
    for seed in (4, 5, 5):
        outs.append(llm.generate({"prompt": text, "multi_modal_data": {"image": image(seed, (70, 90))}}, GREEDY,
                                 use_tqdm=False)[0])
    assert list(outs[1].outputs[0].token_ids) == hf_greedy(qwen_vl, text, [image(5, (70, 90))], N)
    assert outs[1].num_cached_tokens == 0 and outs[2].num_cached_tokens > 0
    assert list(outs[2].outputs[0].token_ids) == list(outs[1].outputs[0].token_ids)
