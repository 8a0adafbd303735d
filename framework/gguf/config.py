"""A GGUF file's metadata as the Hugging Face config.json the model code reads.

llama.cpp's converter writes each architecture's hyperparameters under
`{arch}.{key}` (`llama.embedding_length`, `llama.attention.head_count_kv`, ...). This
module maps them back onto transformers' names, so a GGUF model runs through the same
architecture classes as its HF folder. The config also carries `portaserve_gguf` (the
file, its architecture and tensor types) for the ExecutionPlan and `/v1/models`, and
for a quantized decoder file a `quantization_config` naming the "gguf" QuantMethod, which
keeps the quantized matrices quantized in memory.
"""

from __future__ import annotations

from typing import Any

from portaserve.framework.errors import invalid

from .file import GGUFFile
from .blocks import BLOCK_TYPES
from .weights import QUANTIZED_ARCHITECTURES, check_gguf_tensors, hf_tensor_name

#: GGUF `general.architecture` -> the HF architecture class it is served by.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "bert": "BertModel",
}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "bert": "bert"}

# general.file_type (llama_ftype) values whose weights are all one float type
_FLOAT_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}

# llama.cpp's pooling_type enum (LLAMA_POOLING_TYPE_*) -> sentence-transformers' modes
_POOLING = {1: "mean", 2: "cls", 3: "last"}


def gguf_model_config(gguf: GGUFFile) -> dict[str, Any]:
    """The HF-style config of a GGUF model file.

    :raises InvalidParameterError: the architecture is not supported (the message lists
        the supported ones), or a required hyperparameter is missing.
    """
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise invalid(
            "model",
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}",
        )
    check_gguf_tensors(gguf)
    config = _bert_config(gguf) if arch == "bert" else _decoder_config(gguf, arch)
    config["architectures"] = [ARCHITECTURES[arch]]
    config["model_type"] = _MODEL_TYPES[arch]
    config["torch_dtype"] = _file_dtype(gguf)
    config["portaserve_gguf"] = {
        "file": str(gguf.path),
        "architecture": arch,
        "name": gguf.get("general.name"),
        "tensor_types": gguf.tensor_types(),
    }
    quantization = gguf_quantization_config(gguf)
    if quantization is not None:
        config["quantization_config"] = quantization
    return config


def gguf_quantization_config(gguf: GGUFFile) -> dict[str, Any] | None:
    """`{"quant_method": "gguf", "tensor_types": {HF weight name: GGML type}}` for a decoder
    file with quantized matrices (the plan then keeps them quantized: the "gguf"
    QuantMethod), else None (a float file, or an encoder: dequantized at load)."""
    arch = gguf.architecture
    if arch not in QUANTIZED_ARCHITECTURES:
        return None
    types = {}
    for tensor in gguf.tensors:
        name = hf_tensor_name(arch, tensor.name)
        if len(tensor.shape) == 2 and name is not None and name.endswith(".weight"):
            types[name] = tensor.type_name
    if not any(t in BLOCK_TYPES for t in types.values()):
        return None
    return {"quant_method": "gguf", "tensor_types": types}


def describe_gguf(info: dict[str, Any]) -> str:
    """One line for the plan: the file, its architecture and its tensor types."""
    types = ", ".join(f"{name} x{count}" for name, count in info.get("tensor_types", {}).items())
    return f"GGUF file {info.get('file')} (architecture {info.get('architecture')}; tensors {types})"


def _file_dtype(gguf: GGUFFile) -> str:
    """The dtype the weights load in by default: the file's float type, bfloat16 for quantized files."""
    file_type = gguf.get("general.file_type")
    if file_type in _FLOAT_FILE_TYPES:
        return _FLOAT_FILE_TYPES[file_type]
    matrices = {t.type_name for t in gguf.tensors if len(t.shape) == 2}
    for name, dtype in (("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16")):
        if matrices == {name}:
            return dtype
    return "bfloat16"


def _vocab_size(gguf: GGUFFile) -> int:
    value = gguf.arch_key("vocab_size")
    if value is None:
        tokens = gguf.get_array("tokenizer.ggml.tokens")
        if tokens is not None:
            return len(tokens)
        embed = next((t for t in gguf.tensors if t.name == "token_embd.weight"), None)
        if embed is None:
            raise invalid("model", f"{gguf.path}: no vocab_size, vocabulary or token_embd.weight to size the model")
        return embed.shape[0]
    return int(value)


def _required(gguf: GGUFFile, suffix: str) -> Any:
    value = gguf.arch_key(suffix)
    if value is None:
        raise invalid("model", f"{gguf.path}: the GGUF file has no {gguf.architecture}.{suffix} metadata")
    return value


def _token_ids(gguf: GGUFFile) -> dict[str, int]:
    out = {}
    for hf_key, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = gguf.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            out[hf_key] = int(value)
    return out


def _rope_scaling(gguf: GGUFFile) -> dict[str, Any] | None:
    kind = gguf.arch_key("rope.scaling.type")
    factor = gguf.arch_key("rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        original = gguf.arch_key("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        for key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            value = gguf.arch_key(key)
            if value is not None:
                scaling[hf_key] = float(value)
        return scaling
    raise invalid("model", f"{gguf.path}: rope scaling type {kind!r} is not supported; supported: none, linear, yarn")


def _decoder_config(gguf: GGUFFile, arch: str) -> dict[str, Any]:
    hidden = int(_required(gguf, "embedding_length"))
    heads = int(_required(gguf, "attention.head_count"))
    kv_heads = gguf.arch_key("attention.head_count_kv", heads)
    names = {t.name for t in gguf.tensors}
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": int(_required(gguf, "feed_forward_length")),
        "num_hidden_layers": int(_required(gguf, "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "max_position_embeddings": int(gguf.arch_key("context_length", 2048)),
        "rms_norm_eps": float(gguf.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(gguf.arch_key("rope.freq_base", 10000.0)),
        "vocab_size": _vocab_size(gguf),
        "hidden_act": "silu",
        # llama.cpp ties the output to the embedding when the file has no output.weight
        "tie_word_embeddings": "output.weight" not in names,
        **_token_ids(gguf),
    }
    head_dim = gguf.arch_key("attention.key_length")
    if head_dim is not None and int(head_dim) != hidden // heads:
        config["head_dim"] = int(head_dim)
    elif arch == "qwen3":
        config["head_dim"] = int(head_dim) if head_dim is not None else hidden // heads
    rope_dims = gguf.arch_key("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != config.get("head_dim", hidden // heads):
        raise invalid(
            "model",
            f"{gguf.path}: partial rotary embeddings ({arch}.rope.dimension_count {rope_dims} of head size "
            f"{config.get('head_dim', hidden // heads)}) are not supported",
        )
    if "rope_freqs.weight" in names:
        raise invalid(
            "model",
            f"{gguf.path}: per-dimension rope frequency factors (rope_freqs.weight, Llama 3.1-style rope scaling) "
            "are not supported in GGUF files yet; use the model's Hugging Face folder",
        )
    scaling = _rope_scaling(gguf)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = "blk.0.ffn_up.bias" in names
    window = gguf.arch_key("attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
        config["use_sliding_window"] = True
    return config


def _bert_config(gguf: GGUFFile) -> dict[str, Any]:
    token_types = next((t for t in gguf.tensors if t.name == "token_types.weight"), None)
    config: dict[str, Any] = {
        "hidden_size": int(_required(gguf, "embedding_length")),
        "intermediate_size": int(_required(gguf, "feed_forward_length")),
        "num_hidden_layers": int(_required(gguf, "block_count")),
        "num_attention_heads": int(_required(gguf, "attention.head_count")),
        "max_position_embeddings": int(_required(gguf, "context_length")),
        "layer_norm_eps": float(gguf.arch_key("attention.layer_norm_epsilon", 1e-12)),
        "vocab_size": _vocab_size(gguf),
        "type_vocab_size": token_types.shape[0] if token_types is not None else 2,
        "hidden_act": "gelu",
        **_token_ids(gguf),
    }
    if gguf.arch_key("attention.causal", False):
        raise invalid("model", f"{gguf.path}: a causal BERT is not supported")
    pooling = gguf.arch_key("pooling_type")
    mode = _POOLING.get(int(pooling)) if pooling is not None else "mean"
    if mode is None:
        raise invalid(
            "model",
            f"{gguf.path}: bert.pooling_type {pooling} is not supported; supported: 1 (mean), 2 (cls), 3 (last)",
        )
    # llama.cpp normalizes embeddings (euclidean) unless asked not to; so do we
    config["portaserve_pooling"] = {"mode": mode, "normalize": True}
    return config
