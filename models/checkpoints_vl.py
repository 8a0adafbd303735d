"""Random-weight vision-language checkpoints for tests: LLaVA (CLIP or SigLIP tower, Qwen2 LM).

The folder is what llava-hf publishes: config.json with `vision_config` and
`text_config`, safetensors in the llava-hf layout (`language_model.model.*`,
`vision_tower.vision_model.*`, `multi_modal_projector.*`), the CLIP image processor's
`preprocessor_config.json`, `processor_config.json`, and the Qwen2 tokenizer whose chat
template renders image parts as `<|vision_start|><|image_pad|><|vision_end|>`;
`<|image_pad|>` is the image token the engine expands. transformers loads the folder
with no missing or unexpected keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from portaserve.framework.errors import invalid

from .checkpoints import _DTYPES, ENDOFTEXT_ID, IM_END_ID, INIT_STD, MLP_OUT_STD, _decoder_tensors, checkpoint_config, save_safetensors

IMAGE_PAD_ID = 151655

_VISION_SHAPES = {
    # 56x56 images in 14-pixel patches: 16 patches, 16 image tokens after dropping CLS
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=56, patch_size=14),
    "small": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, image_size=224, patch_size=14),
}


def llava_config(size: str, vision_tower: str = "clip") -> dict[str, Any]:
    if size not in _VISION_SHAPES:
        raise invalid("size", f"{size!r} is not one of {', '.join(_VISION_SHAPES)} for LLaVA")
    text = checkpoint_config("Qwen2ForCausalLM", size)
    text.pop("architectures")
    text.update(use_sliding_window=False, sliding_window=None, tie_word_embeddings=False)
    dtype = text.pop("torch_dtype")
    if vision_tower not in ("clip", "siglip"):
        raise invalid("vision_tower", f"{vision_tower!r} is not one of clip, siglip")
    if vision_tower == "clip":
        vision = dict(_VISION_SHAPES[size], model_type="clip_vision_model", hidden_act="quick_gelu", layer_norm_eps=1e-5,
                      num_channels=3, projection_dim=32)
    else:
        vision = dict(_VISION_SHAPES[size], model_type="siglip_vision_model", hidden_act="gelu_pytorch_tanh",
                      layer_norm_eps=1e-6, num_channels=3, vision_use_head=True)
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": IMAGE_PAD_ID,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        # SigLIP has no class token to drop: its towers are read whole
        "vision_feature_select_strategy": "default" if vision_tower == "clip" else "full",
        "multimodal_projector_bias": True,
        "image_seq_length": (vision["image_size"] // vision["patch_size"]) ** 2,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "text_config": text,
        "vision_config": vision,
    }


def _vision_tensors(vision: dict[str, Any], prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    hidden, inter = vision["hidden_size"], vision["intermediate_size"]
    patch = vision["patch_size"]
    siglip = vision["model_type"].startswith("siglip")
    positions = (vision["image_size"] // patch) ** 2 + (0 if siglip else 1)
    out = {
        f"{prefix}.embeddings.patch_embedding.weight": ((hidden, 3, patch, patch), "matrix"),
        f"{prefix}.embeddings.position_embedding.weight": ((positions, hidden), "matrix"),
        f"{prefix}.post_layernorm.weight": ((hidden,), "norm"),
        f"{prefix}.post_layernorm.bias": ((hidden,), "bias"),
    }
    if siglip:
        out[f"{prefix}.embeddings.patch_embedding.bias"] = ((hidden,), "bias")
        # the attention-pooling head: part of the layout, unused by LLaVA
        out.update({
            f"{prefix}.head.probe": ((1, 1, hidden), "matrix"),
            f"{prefix}.head.attention.in_proj_weight": ((3 * hidden, hidden), "matrix"),
            f"{prefix}.head.attention.in_proj_bias": ((3 * hidden,), "bias"),
            f"{prefix}.head.attention.out_proj.weight": ((hidden, hidden), "matrix"),
            f"{prefix}.head.attention.out_proj.bias": ((hidden,), "bias"),
            f"{prefix}.head.layernorm.weight": ((hidden,), "norm"),
            f"{prefix}.head.layernorm.bias": ((hidden,), "bias"),
            f"{prefix}.head.mlp.fc1.weight": ((inter, hidden), "matrix"),
            f"{prefix}.head.mlp.fc1.bias": ((inter,), "bias"),
            f"{prefix}.head.mlp.fc2.weight": ((hidden, inter), "matrix"),
            f"{prefix}.head.mlp.fc2.bias": ((hidden,), "bias"),
        })
    else:
        out[f"{prefix}.embeddings.class_embedding"] = ((hidden,), "matrix")
        out[f"{prefix}.pre_layrnorm.weight"] = ((hidden,), "norm")
        out[f"{prefix}.pre_layrnorm.bias"] = ((hidden,), "bias")
    for i in range(vision["num_hidden_layers"]):
        p = f"{prefix}.encoder.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[f"{p}.self_attn.{name}.weight"] = ((hidden, hidden), "matrix")
            out[f"{p}.self_attn.{name}.bias"] = ((hidden,), "bias")
        for norm in ("layer_norm1", "layer_norm2"):
            out[f"{p}.{norm}.weight"] = ((hidden,), "norm")
            out[f"{p}.{norm}.bias"] = ((hidden,), "bias")
        out[f"{p}.mlp.fc1.weight"] = ((inter, hidden), "matrix")
        out[f"{p}.mlp.fc1.bias"] = ((inter,), "bias")
        out[f"{p}.mlp.fc2.weight"] = ((hidden, inter), "matrix")
        out[f"{p}.mlp.fc2.bias"] = ((hidden,), "bias")
    return out


def _llava_tensors(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    text = dict(config["text_config"], architectures=["Qwen2ForCausalLM"])
    out = {f"language_model.{k}": v for k, v in _decoder_tensors(text).items()}
    # a 0.02-std patch embedding over normalized pixels gives a tower that barely sees
    # the image; "vision" kinds are drawn larger so different images give different text
    out.update({k: (shape, "vision" if kind == "matrix" else kind) for k, (shape, kind) in
                _vision_tensors(config["vision_config"], "vision_tower.vision_model").items()})
    v_hidden, t_hidden = config["vision_config"]["hidden_size"], text["hidden_size"]
    out["multi_modal_projector.linear_1.weight"] = ((t_hidden, v_hidden), "vision")
    out["multi_modal_projector.linear_1.bias"] = ((t_hidden,), "bias")
    out["multi_modal_projector.linear_2.weight"] = ((t_hidden, t_hidden), "vision")
    out["multi_modal_projector.linear_2.bias"] = ((t_hidden,), "bias")
    return out


def _image_processor_config(vision_tower: str, side: int) -> dict[str, Any]:
    if vision_tower == "siglip":
        return {"image_processor_type": "SiglipImageProcessor", "processor_class": "LlavaProcessor", "do_resize": True,
                "size": {"height": side, "width": side}, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
                "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}
    return {
        "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
        "do_resize": True, "size": {"shortest_edge": side}, "resample": 3,
        "do_center_crop": True, "crop_size": {"height": side, "width": side},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
    }


_STD = {"matrix": INIT_STD, "bias": INIT_STD, "norm": INIT_STD, "mlp_out": MLP_OUT_STD, "vision": 0.2}


def write_llava(out_dir: str | os.PathLike, size: str = "tiny", seed: int = 0, *, dtype: str | None = None,
                vision_tower: str = "clip", **_: Any) -> Path:
    """A random-weight LLaVA checkpoint (a CLIP or SigLIP tower, a Qwen2 language model) in `out_dir`."""
    from portaserve.models.tokenizer_files import write_qwen2_tokenizer

    config = llava_config(size, vision_tower)
    if dtype is not None:
        if dtype not in _DTYPES:
            raise invalid("dtype", f"{dtype!r} is not one of {', '.join(_DTYPES)}")
        config["torch_dtype"] = dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (shape, kind) in _llava_tensors(config).items():
        values = torch.randn(shape, generator=gen) * _STD[kind]
        if kind == "norm":
            values += 1.0
        tensors[name] = values.to(_DTYPES[config["torch_dtype"]])
    save_safetensors(tensors, out)
    vision = config["vision_config"]
    side = vision["image_size"]
    files = {
        "config.json": config,
        "generation_config.json": {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID]},
        "preprocessor_config.json": _image_processor_config(vision_tower, side),
        "processor_config.json": {
            "processor_class": "LlavaProcessor", "patch_size": vision["patch_size"],
            "vision_feature_select_strategy": config["vision_feature_select_strategy"],
            "num_additional_image_tokens": 1 if vision_tower == "clip" else 0, "image_token": "<|image_pad|>",
        },
    }
    for name, obj in files.items():
        (out / name).write_text(json.dumps(obj, indent=2) + "\n")
    write_qwen2_tokenizer(out, template="chatml_vision")
    return out
