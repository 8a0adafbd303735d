"""Write a compressed-tensors checkpoint (as llm-compressor saves one) from a float one:
the linear layers' weights quantized per output channel, `weight` + `weight_scale` [out, 1],
and config.json's `quantization_config` describing the scheme."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from portaserve.framework.quantization.fp8 import quantize_fp8
from portaserve.framework.quantization.int8 import quantize_int8_per_channel

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

W8A16 = {
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                "group_size": None, "observer": "minmax", "actorder": None, "block_structure": None},
    "input_activations": None,
    "output_activations": None,
    "targets": ["Linear"],
}
FP8_DYNAMIC = {
    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
                "group_size": None, "observer": "minmax"},
    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True,
                          "observer": None},
    "output_activations": None,
    "targets": ["Linear"],
}


def quantization_config(scheme: str, ignore=("lm_head",), fmt: str | None = None, **extra) -> dict:
    group = W8A16 if scheme == "W8A16" else FP8_DYNAMIC
    return {
        "quant_method": "compressed-tensors",
        "format": fmt or ("int-quantized" if scheme == "W8A16" else "float-quantized"),
        "quantization_status": "compressed",
        "config_groups": {"group_0": json.loads(json.dumps(group))},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        **extra,
    }


def write_compressed(src: str | Path, dst: str | Path, scheme: str = "W8A16", scale_dtype=torch.float32,
                     skip: tuple[str, ...] = (), quantize_from: torch.dtype = torch.float32, **config_extra) -> Path:
    """Copy checkpoint `src` to `dst` with its linear weights quantized (`skip`: name
    substrings of layers left in float, listed in `ignore`). `quantize_from`: the dtype the
    weights are rounded to first (an online-quantized model quantizes its loaded weights)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    out, ignored = {}, []
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS and not any(s in name for s in skip):
            t = t.to(quantize_from)
            if scheme == "W8A16":
                q, scale = quantize_int8_per_channel(t)
                scale = scale[:, None]
            else:
                q, scale = quantize_fp8(t, dim=1)
            out[name] = q.contiguous()
            out[f"{module}.weight_scale"] = scale.to(scale_dtype).contiguous()
        else:
            if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
                ignored.append(module)
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme, ignore=["lm_head", *ignored], **config_extra)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
