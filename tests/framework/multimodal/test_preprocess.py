"""Image preprocessing against transformers' Pillow-based image processors (the slow
ones: `backend="pil"`), which every supported checkpoint's processor config names.

Random images of several sizes, aspect ratios and modes (RGB, RGBA composited onto
white, grayscale, palette), under each processor's resize rule: CLIP's shortest edge
then center crop, SigLIP's fixed size, Qwen2-VL's dynamic resolution and patching.
"""

from __future__ import annotations

import numpy as np
import pytest

from portaserve.framework.errors import InvalidParameterError, UnsupportedError
from portaserve.framework.multimodal.preprocess import (
    FixedSizeImageProcessor,
    Qwen2VLImageProcessor,
    build_image_processor,
    read_processor_config,
)

transformers = pytest.importorskip("transformers")

from PIL import Image  # noqa: E402


def reference(name: str, **kwargs):
    # imported when used: these modules import triton, which the kernel tests must import
    # themselves (under TRITON_INTERPRET) if they are collected later
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    classes = {"clip": CLIPImageProcessorPil, "siglip": SiglipImageProcessorPil, "qwen2-vl": Qwen2VLImageProcessorPil}
    return classes[name](**kwargs)

SHAPES = [(37, 53, "RGB"), (300, 201, "RGBA"), (64, 64, "L"), (17, 90, "P"), (224, 224, "RGB"), (500, 40, "RGB")]


def random_image(h: int, w: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = 4 if mode == "RGBA" else 3
    return Image.fromarray(rng.integers(0, 256, (h, w, channels), dtype=np.uint8)).convert(mode)


CASES = {
    "clip": (lambda: reference("clip", size={"shortest_edge": 42}, crop_size={"height": 42, "width": 42}),
             {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 42},
              "crop_size": {"height": 42, "width": 42}}),
    "clip-default": (lambda: reference("clip"), {"image_processor_type": "CLIPImageProcessor"}),
    "siglip": (lambda: reference("siglip", size={"height": 32, "width": 48}),
               {"image_processor_type": "SiglipImageProcessor", "size": {"height": 32, "width": 48}}),
    "qwen2-vl": (lambda: reference("qwen2-vl", size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}),
                 {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("h, w, mode", SHAPES)
def test_pixel_values_match_transformers(case, h, w, mode):
    make_reference, config = CASES[case]
    image = random_image(h, w, mode, seed=h * w)
    ref = make_reference()(image, return_tensors="np")
    ours = build_image_processor(config, "CLIPImageProcessor")(image)
    expected = ref["pixel_values"]
    if "image_grid_thw" in ref:
        assert ours.grid_thw == tuple(int(v) for v in ref["image_grid_thw"][0])
    else:
        expected = expected[0]
    assert ours.pixel_values.shape == expected.shape
    assert np.abs(ours.pixel_values - expected).max() <= 1e-5


def test_processor_config_files_are_read(tmp_path):
    assert read_processor_config(tmp_path) == {}
    (tmp_path / "processor_config.json").write_text('{"image_processor": {"image_processor_type": "SiglipImageProcessor"}}')
    assert read_processor_config(tmp_path)["image_processor_type"] == "SiglipImageProcessor"
    (tmp_path / "preprocessor_config.json").write_text('{"image_processor_type": "CLIPImageProcessor"}')
    assert read_processor_config(tmp_path)["image_processor_type"] == "CLIPImageProcessor"


def test_unsupported_settings_are_clear_errors():
    with pytest.raises(UnsupportedError, match="LlavaNextImageProcessor"):
        build_image_processor({"image_processor_type": "LlavaNextImageProcessor"}, "CLIPImageProcessor")
    with pytest.raises(InvalidParameterError, match="resample"):
        FixedSizeImageProcessor({"resample": 42})
    with pytest.raises(InvalidParameterError, match="aspect ratio"):
        Qwen2VLImageProcessor({})(random_image(2, 600, "RGB", 0))
