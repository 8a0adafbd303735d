"""Image preprocessing from a checkpoint's own processor config, with Pillow and NumPy.

Two families of processors cover the supported vision-language models:

- `FixedSizeImageProcessor`: CLIP's and SigLIP's (`CLIPImageProcessor`,
  `SiglipImageProcessor`): resize (shortest edge, or to a fixed height x width),
  center crop, rescale, normalize; one [3, H, W] image.
- `Qwen2VLImageProcessor`: dynamic resolution: resize each side to a multiple of
  patch_size x merge_size within a pixel budget, then cut the image into patches,
  each repeated `temporal_patch_size` times (an image is a one-frame video), giving
  [num_patches, 3 * t * p * p] and the (t, h, w) patch grid.

Each step matches the Pillow-based ("slow", `use_fast=False`) image processors of
transformers (their `PilBackend`): Pillow does the resize on uint8 pixels, NumPy the
arithmetic in float64 where they do, so pixel values agree to float32 rounding.
Transparency is composited onto white before anything else, as theirs does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from portaserve.framework.errors import UnsupportedError, invalid

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)

# PIL resample codes as the configs store them (PIL.Image.Resampling values)
_RESAMPLE_NAMES = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    """One image as the vision encoder reads it."""

    pixel_values: np.ndarray  # float32
    grid_thw: tuple[int, ...] = ()  # dynamic-resolution models only


def to_rgb(image):
    """A PIL image in RGB, transparency composited onto white (transformers' convert_to_rgb)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _resample(value: Any) -> int:
    code = 3 if value is None else int(value)
    if code not in _RESAMPLE_NAMES:
        raise invalid("resample", f"processor config: resample {value!r} is not a PIL resampling filter")
    return code


def _resize(image, height: int, width: int, resample: int):
    """PIL image -> float64 array [3, height, width] with values 0..255."""
    if (image.height, image.width) != (height, width):
        image = image.resize((width, height), resample=resample)
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)


def _rescale_normalize(pixels: np.ndarray, cfg: "_Common") -> np.ndarray:
    out = pixels
    if cfg.do_rescale:
        out = (out.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.do_normalize:
        if not np.issubdtype(out.dtype, np.floating):
            out = out.astype(np.float32)
        mean = np.asarray(cfg.image_mean, dtype=out.dtype).reshape(-1, 1, 1)
        std = np.asarray(cfg.image_std, dtype=out.dtype).reshape(-1, 1, 1)
        out = (out - mean) / std
    return np.ascontiguousarray(out, dtype=np.float32)


@dataclass(frozen=True, slots=True)
class _Common:
    do_resize: bool
    resample: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]


def _common(cfg: dict, mean: tuple[float, ...], std: tuple[float, ...]) -> _Common:
    def triple(value, default):
        if value is None:
            return default
        values = (float(value),) * 3 if isinstance(value, (int, float)) else tuple(float(v) for v in value)
        return values

    return _Common(
        do_resize=bool(cfg.get("do_resize", True)),
        resample=_resample(cfg.get("resample", 3)),
        do_rescale=bool(cfg.get("do_rescale", True)),
        rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
        do_normalize=bool(cfg.get("do_normalize", True)),
        image_mean=triple(cfg.get("image_mean"), mean),
        image_std=triple(cfg.get("image_std"), std),
    )


class FixedSizeImageProcessor:
    """CLIP / SigLIP preprocessing: one [3, H, W] image of the encoder's input size."""

    def __init__(self, cfg: dict, *, siglip: bool = False) -> None:
        self.common = _common(cfg, HALF if siglip else OPENAI_CLIP_MEAN, HALF if siglip else OPENAI_CLIP_STD)
        size = cfg.get("size", {"height": 224, "width": 224} if siglip else {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"height": size, "width": size} if siglip else {"shortest_edge": size}
        self.size = dict(size)
        self.do_center_crop = bool(cfg.get("do_center_crop", not siglip))
        crop = cfg.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        self.crop = (int(crop["height"]), int(crop["width"]))
        if not ("shortest_edge" in self.size or ("height" in self.size and "width" in self.size)):
            raise UnsupportedError(f"image processor size {self.size}: only shortest_edge or height/width are supported")

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after resizing (before any crop), as transformers computes it."""
        if "shortest_edge" in self.size:
            target = int(self.size["shortest_edge"])
            short, long = (width, height) if width <= height else (height, width)
            new_long = int(target * long / short)
            return (new_long, target) if width <= height else (target, new_long)
        return int(self.size["height"]), int(self.size["width"])

    def __call__(self, image) -> ProcessedImage:
        image = to_rgb(image)
        if self.common.do_resize:
            height, width = self.output_size(image.height, image.width)
            pixels = _resize(image, height, width, self.common.resample)
        else:
            pixels = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
        if self.do_center_crop:
            pixels = center_crop(pixels, *self.crop)
        return ProcessedImage(_rescale_normalize(pixels, self.common))


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """[C, H, W] -> [C, height, width] around the center; zero-padded where the image is smaller."""
    _, h, w = pixels.shape
    if h < height or w < width:
        new_h, new_w = max(h, height), max(w, width)
        padded = np.zeros((pixels.shape[0], new_h, new_w), dtype=pixels.dtype)
        top, left = (new_h - h) // 2, (new_w - w) // 2
        padded[:, top : top + h, left : left + w] = pixels
        pixels, h, w = padded, new_h, new_w
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[:, top : top + height, left : left + width]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of `factor`, the area within
    [min_pixels, max_pixels], the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise invalid("image", f"aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen2VLImageProcessor:
    """Qwen2-VL / Qwen2.5-VL preprocessing: dynamic resolution, flattened patches."""

    def __init__(self, cfg: dict) -> None:
        self.common = _common(cfg, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
        size = dict(cfg.get("size") or {})
        self.min_pixels = int(cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        self.max_pixels = int(cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        self.patch_size = int(cfg.get("patch_size", 14))
        self.temporal_patch_size = int(cfg.get("temporal_patch_size", 2))
        self.merge_size = int(cfg.get("merge_size", 2))

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def __call__(self, image) -> ProcessedImage:
        image = to_rgb(image)
        height, width = image.height, image.width
        if self.common.do_resize:
            height, width = self.output_size(height, width)
        pixels = _rescale_normalize(_resize(image, height, width, self.common.resample), self.common)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        # [C, H, W] -> patches ordered by merge window (2x2 patches that the merger joins
        # are adjacent), each patch's values ordered (C, t, p, p)
        patches = pixels.reshape(3, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
        flat = np.ascontiguousarray(patches.reshape(grid_h * grid_w, 3 * t * p * p), dtype=np.float32)
        return ProcessedImage(flat, (1, grid_h, grid_w))


_PROCESSORS = {
    "CLIPImageProcessor": lambda cfg: FixedSizeImageProcessor(cfg),
    "CLIPImageProcessorPil": lambda cfg: FixedSizeImageProcessor(cfg),
    "SiglipImageProcessor": lambda cfg: FixedSizeImageProcessor(cfg, siglip=True),
    "SiglipImageProcessorPil": lambda cfg: FixedSizeImageProcessor(cfg, siglip=True),
    "Qwen2VLImageProcessor": Qwen2VLImageProcessor,
    "Qwen2VLImageProcessorPil": Qwen2VLImageProcessor,
}


def read_processor_config(model_path: str | Path) -> dict:
    """The image-processor settings of a checkpoint folder: `preprocessor_config.json`, or
    the `image_processor` entry of `processor_config.json` (newer transformers); {} if none."""
    folder = Path(model_path)
    for name in ("preprocessor_config.json", "processor_config.json"):
        file = folder / name
        if file.is_file():
            data = json.loads(file.read_text())
            if name == "processor_config.json" and isinstance(data.get("image_processor"), dict):
                return data["image_processor"]
            if "image_processor_type" in data or name == "preprocessor_config.json":
                return data
    return {}


def build_image_processor(cfg: dict, default_type: str):
    kind = str(cfg.get("image_processor_type") or default_type)
    factory = _PROCESSORS.get(kind)
    if factory is None:
        raise UnsupportedError(f"image processor {kind!r} is not supported; supported: {', '.join(sorted(_PROCESSORS))}")
    return factory(cfg)
