"""A GGUF file's tensors under their Hugging Face names, dequantized.

llama.cpp names tensors `blk.{i}.attn_q.weight`, `token_embd.weight`, ...; the model
code loads HF names (`model.layers.{i}.self_attn.q_proj.weight`). This module renames
them, dequantizes every tensor with `gguf.quants` (llama.cpp's own reference
dequantization, in numpy) and undoes the one layout change llama.cpp's converter makes:
for the `llama` architecture it permutes the rows of the Q and K projections (pairs
(i, i + d/2) of each head become adjacent, the interleaved rotary layout llama.cpp's
kernels use), which transformers' rotate-half layout needs undone.

Two modes. Dequantized (`keep_quantized=False`): quantized tensors become float32 here
and the loader converts them to the model's dtype as it copies them in, one tensor at a
time. Quantized (the "gguf" QuantMethod, `keep_quantized=True`): every matrix becomes
`name` (uint8 codes), `name_scale` and `name_min` (float32, one per 16 weights; see
`blocks`), exactly what the file stores; a float matrix or a type `blocks` does not
read (Q2_K, Q3_K) is encoded to 8-bit codes with a scale and a min per 16 weights
(asymmetric rounding: an error far below the 2-3-bit types' own). 1-D tensors (norms,
biases) stay float either way.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from portaserve.framework.errors import invalid

from .file import GGUFFile, GGUFTensor

#: GGUF architectures whose matrices can stay quantized (the decoders; BERT is dequantized).
QUANTIZED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

#: GGML tensor types the loader dequantizes (ggml's names).
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)

_DECODER_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_DECODER_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BERT_TOP = {
    "token_embd": "embeddings.word_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}
_BERT_BLOCK = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
#: architecture -> (top-level names, per-block names, the HF prefix of block i)
_NAME_MAPS = {
    "llama": (_DECODER_TOP, _DECODER_BLOCK, "model.layers.{}."),
    "qwen2": (_DECODER_TOP, _DECODER_BLOCK, "model.layers.{}."),
    "qwen3": (_DECODER_TOP, _DECODER_BLOCK, "model.layers.{}."),
    "bert": (_BERT_TOP, _BERT_BLOCK, "encoder.layer.{}."),
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_NAME = re.compile(r"(\w+)\.(weight|bias)$")


def hf_tensor_name(arch: str, name: str) -> str | None:
    """The HF name of GGUF tensor `name`, or None when the architecture has no such tensor."""
    top, block, prefix = _NAME_MAPS[arch]
    match = _BLOCK_NAME.match(name)
    if match is not None:
        layer, part, kind = match.groups()
        mapped = block.get(part)
        return f"{prefix.format(layer)}{mapped}.{kind}" if mapped else None
    match = _TOP_NAME.match(name)
    if match is not None:
        mapped = top.get(match.group(1))
        return f"{mapped}.{match.group(2)}" if mapped else None
    return None


def check_gguf_tensors(gguf: GGUFFile) -> None:
    """Fail before any weight loads on a tensor type or name the loader cannot handle.

    :raises InvalidParameterError: names the file, the tensor and what is supported.
    """
    arch = gguf.architecture
    for tensor in gguf.tensors:
        if tensor.type_name not in SUPPORTED_TENSOR_TYPES:
            raise invalid(
                "model",
                f"{gguf.path}: tensor {tensor.name!r} has GGML type {tensor.type_name}, which portaserve cannot "
                f"load; supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}",
            )
        if arch in _NAME_MAPS and hf_tensor_name(arch, tensor.name) is None:
            raise invalid(
                "model", f"{gguf.path}: tensor {tensor.name!r} is not part of a {arch} model as portaserve builds it"
            )


def dequantize_tensor(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor's values in torch order: float types as stored, quantized types as float32."""
    data = tensor.data
    if tensor.type_name in ("F32", "F16"):
        array = np.asarray(data)
    elif tensor.type_name == "BF16":
        raw = np.ascontiguousarray(data).view(np.uint16).reshape(tensor.shape)
        return torch.from_numpy(raw.copy()).view(torch.bfloat16)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        array = dequantize(np.asarray(data), GGMLQuantizationType[tensor.type_name])
    # a copy: the file's memory map is read-only and may close with the reader
    return torch.from_numpy(np.array(array, copy=True).reshape(tensor.shape))


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (`LlamaModel.permute` in its converter).

    The converter turns each head's rows [0..d/2) and [d/2..d) into interleaved pairs;
    this puts them back in rotate-half order. Works for weights and biases.
    """
    # weight: [num_heads * head_dim, ...]
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def encode_8bit(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float matrix as 8-bit codes with a scale and a min per 16 weights (asymmetric)."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // 16, 16)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = (high - low) / 255
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 255).to(torch.uint8)
    return codes.reshape(rows, cols), scale, low


def quantized_parts(tensor: GGUFTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, mins) of a matrix, in torch order."""
    from .blocks import BLOCK_TYPES, decompose

    rows, cols = tensor.shape
    if tensor.type_name in BLOCK_TYPES:
        parts = decompose(np.asarray(tensor.data), tensor.type_name, (rows, cols))
        return tuple(torch.from_numpy(np.ascontiguousarray(p)) for p in parts)
    return encode_8bit(dequantize_tensor(tensor))


def iter_gguf_weights(
    gguf: GGUFFile, progress: bool = False, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every tensor of the file, one at a time.

    :param keep_quantized: yield matrices as codes, scales and mins (see the module
        docstring) instead of dequantizing them.
    """
    from tqdm.auto import tqdm

    check_gguf_tensors(gguf)
    arch = gguf.architecture
    heads = int(gguf.arch_key("attention.head_count", 0) or 0)
    kv_heads = int(gguf.arch_key("attention.head_count_kv", heads) or heads)
    for tensor in tqdm(gguf.tensors, desc="Loading GGUF", unit="tensor", disable=not progress, leave=False):
        name = hf_tensor_name(arch, tensor.name)
        if keep_quantized and len(tensor.shape) == 2 and name.endswith(".weight"):
            values = dict(zip((name, name + "_scale", name + "_min"), quantized_parts(tensor)))
        else:
            values = {name: dequantize_tensor(tensor)}
        for out_name, value in values.items():
            if arch == "llama":
                if ".self_attn.q_proj." in name:
                    value = unpermute_rotary_rows(value, heads)
                elif ".self_attn.k_proj." in name:
                    value = unpermute_rotary_rows(value, kv_heads)
            yield out_name, value
