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


def _write_folder(out_dir, config: dict, layout, files: dict, seed: int, dtype: str | None) -> Path:
    """config.json, generation_config.json, `files`, random weights of `layout(config)` (drawn
    in name order: the same seed gives the same weights) and the Qwen2 tokenizer with the
    vision chat template."""
    from portaserve.models.tokenizer_files import write_qwen2_tokenizer

    if dtype is not None:
        if dtype not in _DTYPES:
            raise invalid("dtype", f"{dtype!r} is not one of {', '.join(_DTYPES)}")
        config["torch_dtype"] = dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (shape, kind) in layout(config).items():
        values = torch.randn(shape, generator=gen) * _STD[kind]
        if kind == "norm":
            values += 1.0
        tensors[name] = values.to(_DTYPES[config["torch_dtype"]])
    save_safetensors(tensors, out)
    generation = {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID]}
    for name, obj in {"config.json": config, "generation_config.json": generation, **files}.items():
        (out / name).write_text(json.dumps(obj, indent=2) + "\n")
    write_qwen2_tokenizer(out, template="chatml_vision")
    return out


_STD = {"matrix": INIT_STD, "bias": INIT_STD, "norm": INIT_STD, "mlp_out": MLP_OUT_STD, "vision": 0.2}


def write_llava(out_dir: str | os.PathLike, size: str = "tiny", seed: int = 0, *, dtype: str | None = None,
                vision_tower: str = "clip", **_: Any) -> Path:
    """A random-weight LLaVA checkpoint (a CLIP or SigLIP tower, a Qwen2 language model) in `out_dir`."""
    config = llava_config(size, vision_tower)
    vision = config["vision_config"]
    side = vision["image_size"]
    files = {
        "preprocessor_config.json": _image_processor_config(vision_tower, side),
        "processor_config.json": {
            "processor_class": "LlavaProcessor", "patch_size": vision["patch_size"],
            "vision_feature_select_strategy": config["vision_feature_select_strategy"],
            "num_additional_image_tokens": 1 if vision_tower == "clip" else 0, "image_token": "<|image_pad|>",
        },
    }
    return _write_folder(out_dir, config, _llava_tensors, files, seed, dtype)


# ----- Qwen2-VL / Qwen2.5-VL --------------------------------------------------------------

_QWEN_VL_ARCH = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def qwen_vl_config(size: str, variant: str = "qwen2_vl") -> dict[str, Any]:
    if size != "tiny":
        raise invalid("size", f"{size!r}: Qwen2-VL test checkpoints come in size tiny only")
    text = checkpoint_config("Qwen2ForCausalLM", "tiny")
    text.pop("architectures")
    dtype = text.pop("torch_dtype")
    text.update(model_type=f"{variant}_text", use_sliding_window=False, sliding_window=None, tie_word_embeddings=False,
                num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "mrope_section": [2, 3, 3]})
    text.pop("rope_theta", None)
    if variant == "qwen2_vl":
        vision = dict(model_type="qwen2_vl_vision", depth=2, embed_dim=32, hidden_size=text["hidden_size"], num_heads=2,
                      mlp_ratio=2, hidden_act="quick_gelu", in_channels=3, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2)
    elif variant == "qwen2_5_vl":
        # windows of 56 pixels (2 x 2 merged tokens); block 1 attends over the whole image
        vision = dict(model_type="qwen2_5_vl", depth=3, hidden_size=32, out_hidden_size=text["hidden_size"],
                      intermediate_size=64, num_heads=2, hidden_act="silu", in_channels=3, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    else:
        raise invalid("variant", f"{variant!r} is not one of {', '.join(_QWEN_VL_ARCH)}")
    return {
        "architectures": [_QWEN_VL_ARCH[variant]], "model_type": variant, "torch_dtype": dtype,
        "image_token_id": IMAGE_PAD_ID, "video_token_id": IMAGE_PAD_ID + 1,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653, "tie_word_embeddings": False,
        "text_config": text, "vision_config": vision,
    }


def _qwen_vl_tensors(config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    text = dict(config["text_config"], architectures=["Qwen2ForCausalLM"])
    out = dict(_decoder_tensors(text))
    vc = config["vision_config"]
    qwen25 = config["model_type"] == "qwen2_5_vl"
    dim = vc["hidden_size"] if qwen25 else vc["embed_dim"]
    out_dim = vc["out_hidden_size"] if qwen25 else vc["hidden_size"]
    p, t = vc["patch_size"], vc["temporal_patch_size"]
    out["visual.patch_embed.proj.weight"] = ((dim, 3, t, p, p), "vision")
    for i in range(vc["depth"]):
        b = f"visual.blocks.{i}"
        for norm in ("norm1", "norm2"):
            out[f"{b}.{norm}.weight"] = ((dim,), "norm")
            if not qwen25:
                out[f"{b}.{norm}.bias"] = ((dim,), "bias")
        out[f"{b}.attn.qkv.weight"] = ((3 * dim, dim), "vision")
        out[f"{b}.attn.qkv.bias"] = ((3 * dim,), "bias")
        out[f"{b}.attn.proj.weight"] = ((dim, dim), "vision")
        out[f"{b}.attn.proj.bias"] = ((dim,), "bias")
        if qwen25:
            inter = vc["intermediate_size"]
            for name, shape in (("gate_proj", (inter, dim)), ("up_proj", (inter, dim)), ("down_proj", (dim, inter))):
                out[f"{b}.mlp.{name}.weight"] = (shape, "vision")
                out[f"{b}.mlp.{name}.bias"] = ((shape[0],), "bias")
        else:
            inter = int(dim * vc["mlp_ratio"])
            out[f"{b}.mlp.fc1.weight"] = ((inter, dim), "vision")
            out[f"{b}.mlp.fc1.bias"] = ((inter,), "bias")
            out[f"{b}.mlp.fc2.weight"] = ((dim, inter), "vision")
            out[f"{b}.mlp.fc2.bias"] = ((dim,), "bias")
    width = dim * vc["spatial_merge_size"] ** 2
    out["visual.merger.ln_q.weight"] = ((dim,), "norm")
    if not qwen25:
        out["visual.merger.ln_q.bias"] = ((dim,), "bias")
    out["visual.merger.mlp.0.weight"] = ((width, width), "vision")
    out["visual.merger.mlp.0.bias"] = ((width,), "bias")
    out["visual.merger.mlp.2.weight"] = ((out_dim, width), "vision")
    out["visual.merger.mlp.2.bias"] = ((out_dim,), "bias")
    return out


def write_qwen_vl(out_dir: str | os.PathLike, size: str = "tiny", seed: int = 0, *, dtype: str | None = None,
                  variant: str = "qwen2_vl", **_: Any) -> Path:
    """A random-weight Qwen2-VL (or, `variant="qwen2_5_vl"`, Qwen2.5-VL) checkpoint in the
    hub's layout (`model.layers.*`, `visual.*`, `lm_head.*`) with its image processor's config."""
    config = qwen_vl_config(size, variant)
    min_pixels, max_pixels = 56 * 56, 28 * 28 * 32
    files = {
        "preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"
            if variant == "qwen2_5_vl" else "Qwen2VLProcessor",
            "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_convert_rgb": True, "min_pixels": min_pixels, "max_pixels": max_pixels,
            "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
            "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        },
    }
    return _write_folder(out_dir, config, _qwen_vl_tensors, files, seed, dtype)


def write_qwen2_vl(out_dir: str | os.PathLike, size: str = "tiny", seed: int = 0, **kwargs: Any) -> Path:
    return write_qwen_vl(out_dir, size, seed, variant="qwen2_vl", **kwargs)


def write_qwen2_5_vl(out_dir: str | os.PathLike, size: str = "tiny", seed: int = 0, **kwargs: Any) -> Path:
    return write_qwen_vl(out_dir, size, seed, variant="qwen2_5_vl", **kwargs)
