"""A GGUF file's tensors under their Hugging Face names, dequantized.

llama.cpp names tensors `blk.{i}.attn_q.weight`, `token_embd.weight`, ...; the model
code loads HF names (`model.layers.{i}.self_attn.q_proj.weight`). This module renames
them, dequantizes every tensor with `gguf.quants` (llama.cpp's own reference
dequantization, in numpy) and undoes the one layout change llama.cpp's converter makes:
for the `llama` architecture it permutes the rows of the Q and K projections (pairs
(i, i + d/2) of each head become adjacent, the interleaved rotary layout llama.cpp's
kernels use), which transformers' rotate-half layout needs undone.

Quantized tensors are dequantized to float32 here; the loader converts them to the
model's dtype as it copies them into their parameters, one tensor at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from portaserve.framework.errors import invalid

from .file import GGUFFile, GGUFTensor

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


def iter_gguf_weights(gguf: GGUFFile, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every tensor of the file, one at a time."""
    from tqdm.auto import tqdm

    check_gguf_tensors(gguf)
    arch = gguf.architecture
    heads = int(gguf.arch_key("attention.head_count", 0) or 0)
    kv_heads = int(gguf.arch_key("attention.head_count_kv", heads) or heads)
    for tensor in tqdm(gguf.tensors, desc="Loading GGUF", unit="tensor", disable=not progress, leave=False):
        name = hf_tensor_name(arch, tensor.name)
        value = dequantize_tensor(tensor)
        if arch == "llama":
            if ".self_attn.q_proj." in name:
                value = unpermute_rotary_rows(value, heads)
            elif ".self_attn.k_proj." in name:
                value = unpermute_rotary_rows(value, kv_heads)
        yield name, value
