"""Deterministic random-weight checkpoints in Hugging Face format, for tests, the demo and benchmarks.

`write_checkpoint(arch, size, out_dir, seed)` writes a complete folder transformers
loads with no missing or unexpected keys: config.json, model.safetensors (or shards
and an index), generation_config.json and the Qwen2 tokenizer; BERT gets a
sentence-transformers layout (modules.json, 1_Pooling/config.json, Normalize).

Sizes: "tiny" for tests (hidden 64, 2-3 layers; each architecture exercises something:
Llama a head_dim unlike hidden/heads, Qwen2 qkv bias, tied embeddings and one sliding
layer, Qwen3 q/k norm with a single KV head, Mistral a sliding window of 8), "small"
for the demo (about 40M parameters, mostly the 151936-row embedding), "bench" shaped
like Qwen2-0.5B (benchmarks only, about 1 GB in bfloat16).

Weights are normal(0, 0.02) like transformers' initializer_range; norm weights are
1 + normal(0, 0.02) and biases normal(0, 0.02), so loading a wrong tensor into a norm
or a bias shows up in parity tests instead of hiding behind ones and zeros. The one
exception is the MLP's output projection (`down_proj`, std 0.32): with every weight at
0.02, a random decoder's next token is set by the attention average over the context
(and, with tied embeddings, by the current token's own embedding), so greedy decoding
repeats one token forever, which would hide a KV cache that is read wrongly. A strong
MLP branch makes each prediction depend on the current token, and continuations vary.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from portaserve.framework.errors import invalid

SIZES = ("tiny", "small", "bench")
#: The Qwen2 tokenizer's (padded) vocabulary: every checkpoint uses the real tokenizer.
VOCAB_SIZE = 151936
ENDOFTEXT_ID = 151643
IM_END_ID = 151645
INIT_STD = 0.02
MLP_OUT_STD = 0.32

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Shapes shared by the decoders at each size (architectures add their own keys below).
_DECODER_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, torch_dtype="float32"),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, torch_dtype="bfloat16"),
    "bench": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=32768, torch_dtype="bfloat16",
                  rope_theta=1000000.0),
}

# Per architecture, per size: what differs from the shared shapes.
_ARCH_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "LlamaForCausalLM": {
        "tiny": dict(head_dim=32, tie_word_embeddings=False),
        "small": dict(tie_word_embeddings=True),
        "bench": dict(tie_word_embeddings=True),
    },
    "Qwen2ForCausalLM": {
        "tiny": dict(num_hidden_layers=3, intermediate_size=160, tie_word_embeddings=True,
                     use_sliding_window=True, sliding_window=16, max_window_layers=2),
        "small": dict(tie_word_embeddings=True),
        "bench": dict(tie_word_embeddings=True),
    },
    "Qwen3ForCausalLM": {
        "tiny": dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=True),
        "small": dict(head_dim=64, tie_word_embeddings=True),
        "bench": dict(head_dim=64, tie_word_embeddings=True),
    },
    "MistralForCausalLM": {
        "tiny": dict(sliding_window=8, tie_word_embeddings=False),
        "small": dict(sliding_window=1024, tie_word_embeddings=True),
        "bench": dict(sliding_window=4096, tie_word_embeddings=True),
    },
}

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "BertModel": "bert",
}

_BERT_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=128, torch_dtype="float32"),
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=512, torch_dtype="float32"),
    "bench": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  max_position_embeddings=512, torch_dtype="bfloat16"),
}

ARCHITECTURES = tuple(_MODEL_TYPES)


def checkpoint_config(arch: str, size: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config.json a checkpoint of `arch` at `size` gets (before `overrides`)."""
    if arch not in _MODEL_TYPES:
        raise invalid("arch", f"arch: no checkpoint writer for {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    if size not in SIZES:
        raise invalid("size", f"size: {size!r} is not one of {', '.join(SIZES)}")
    config: dict[str, Any] = {"architectures": [arch], "model_type": _MODEL_TYPES[arch], "vocab_size": VOCAB_SIZE}
    if arch == "BertModel":
        config.update(_BERT_SHAPES[size])
        config.update(hidden_act="gelu", layer_norm_eps=1e-12, type_vocab_size=2, pad_token_id=ENDOFTEXT_ID,
                      initializer_range=INIT_STD, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    else:
        config.update(_DECODER_SHAPES[size])
        config.update(hidden_act="silu", rms_norm_eps=1e-6, initializer_range=INIT_STD, use_cache=True,
                      bos_token_id=ENDOFTEXT_ID, eos_token_id=ENDOFTEXT_ID)
        config.setdefault("rope_theta", 10000.0)
        config.update(_ARCH_CONFIGS[arch][size])
        if arch == "LlamaForCausalLM":
            config.setdefault("attention_bias", False)
            config.setdefault("mlp_bias", False)
        if arch == "Qwen3ForCausalLM":
            config.setdefault("attention_bias", False)
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            config.setdefault("use_sliding_window", False)
            config.setdefault("sliding_window", None)
            config.setdefault("max_window_layers", config["num_hidden_layers"])
    if overrides:
        config.update(overrides)
    return config


def _decoder_tensors(config: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, kind) for a Llama-family decoder; kind picks the init."""
    arch = config["architectures"][0]
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    qkv_bias = arch == "Qwen2ForCausalLM" or config.get("attention_bias", False)
    o_bias = arch != "Qwen2ForCausalLM" and config.get("attention_bias", False)
    mlp_bias = config.get("mlp_bias", False)
    out: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((config["vocab_size"], hidden), "matrix")}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = ((hidden,), "norm")
        for name, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim), ("v_proj", kv_heads * head_dim)):
            out[f"{p}.self_attn.{name}.weight"] = ((rows, hidden), "matrix")
            if qkv_bias:
                out[f"{p}.self_attn.{name}.bias"] = ((rows,), "bias")
        out[f"{p}.self_attn.o_proj.weight"] = ((hidden, heads * head_dim), "matrix")
        if o_bias:
            out[f"{p}.self_attn.o_proj.bias"] = ((hidden,), "bias")
        if arch == "Qwen3ForCausalLM":
            out[f"{p}.self_attn.q_norm.weight"] = ((head_dim,), "norm")
            out[f"{p}.self_attn.k_norm.weight"] = ((head_dim,), "norm")
        out[f"{p}.post_attention_layernorm.weight"] = ((hidden,), "norm")
        for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            out[f"{p}.mlp.{name}.weight"] = (shape, "mlp_out" if name == "down_proj" else "matrix")
            if mlp_bias:
                out[f"{p}.mlp.{name}.bias"] = ((shape[0],), "bias")
    out["model.norm.weight"] = ((hidden,), "norm")
    if not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = ((config["vocab_size"], hidden), "matrix")
    return out


def _bert_tensors(config: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "embeddings.word_embeddings.weight": ((config["vocab_size"], hidden), "matrix"),
        "embeddings.position_embeddings.weight": ((config["max_position_embeddings"], hidden), "matrix"),
        "embeddings.token_type_embeddings.weight": ((config["type_vocab_size"], hidden), "matrix"),
        "embeddings.LayerNorm.weight": ((hidden,), "norm"),
        "embeddings.LayerNorm.bias": ((hidden,), "bias"),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        for name in ("query", "key", "value"):
            out[f"{p}.attention.self.{name}.weight"] = ((hidden, hidden), "matrix")
            out[f"{p}.attention.self.{name}.bias"] = ((hidden,), "bias")
        out[f"{p}.attention.output.dense.weight"] = ((hidden, hidden), "matrix")
        out[f"{p}.attention.output.dense.bias"] = ((hidden,), "bias")
        out[f"{p}.attention.output.LayerNorm.weight"] = ((hidden,), "norm")
        out[f"{p}.attention.output.LayerNorm.bias"] = ((hidden,), "bias")
        out[f"{p}.intermediate.dense.weight"] = ((inter, hidden), "matrix")
        out[f"{p}.intermediate.dense.bias"] = ((inter,), "bias")
        out[f"{p}.output.dense.weight"] = ((hidden, inter), "matrix")
        out[f"{p}.output.dense.bias"] = ((hidden,), "bias")
        out[f"{p}.output.LayerNorm.weight"] = ((hidden,), "norm")
        out[f"{p}.output.LayerNorm.bias"] = ((hidden,), "bias")
    # BertModel's pooler: unused for sentence embeddings, but part of the HF layout
    out["pooler.dense.weight"] = ((hidden, hidden), "matrix")
    out["pooler.dense.bias"] = ((hidden,), "bias")
    return out


def random_weights(config: Mapping[str, Any], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Deterministic tensors for every checkpoint name of `config`, drawn in name order."""
    layout = _bert_tensors(config) if config["architectures"][0] == "BertModel" else _decoder_tensors(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in layout:
        shape, kind = layout[name]
        values = torch.randn(shape, generator=gen, dtype=torch.float32) * (MLP_OUT_STD if kind == "mlp_out" else INIT_STD)
        if kind == "norm":
            values += 1.0
        tensors[name] = values.to(dtype)
    return tensors


def save_safetensors(tensors: Mapping[str, torch.Tensor], out_dir: Path, max_shard_bytes: int | None = None) -> list[str]:
    """model.safetensors, or shards + model.safetensors.index.json when they exceed `max_shard_bytes`."""
    from safetensors.torch import save_file

    meta = {"format": "pt"}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(dict(tensors), str(out_dir / "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        save_file(shard, str(out_dir / file), metadata=meta)
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _write_sentence_transformers(out_dir: Path, hidden: int, pooling: str, normalize: bool, max_seq_length: int) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out_dir / "2_Normalize").mkdir(exist_ok=True)
    _write_json(out_dir / "modules.json", modules)
    _write_json(
        out_dir / "1_Pooling" / "config.json",
        {
            "word_embedding_dimension": hidden,
            "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean",
            "pooling_mode_max_tokens": pooling == "max",
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": pooling == "last",
            "include_prompt": True,
        },
    )
    _write_json(out_dir / "sentence_bert_config.json", {"max_seq_length": max_seq_length, "do_lower_case": False})


def write_checkpoint(
    arch: str,
    size: str,
    out_dir: str | os.PathLike,
    seed: int = 0,
    *,
    dtype: str | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    max_shard_bytes: int | None = None,
    pooling: str = "mean",
    normalize: bool = True,
    tokenizer: bool = True,
) -> Path:
    """Write a random-weight `arch` checkpoint of `size` into `out_dir`; returns the folder.

    :param dtype: storage dtype (float32, bfloat16, float16); default the size's dtype.
    :param config_overrides: config.json entries to change (rope_scaling, tie_word_embeddings, ...).
    :param max_shard_bytes: split the weights into shards of at most this many bytes.
    :param pooling, normalize: the sentence-transformers pooling a BertModel folder declares.
    """
    config = checkpoint_config(arch, size, config_overrides)
    if dtype is not None:
        if dtype not in _DTYPES:
            raise invalid("dtype", f"dtype: {dtype!r} is not one of {', '.join(_DTYPES)}")
        config["torch_dtype"] = dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = random_weights(config, seed, _DTYPES[config["torch_dtype"]])
    save_safetensors(tensors, out, max_shard_bytes)
    _write_json(out / "config.json", config)
    if arch == "BertModel":
        _write_sentence_transformers(out, config["hidden_size"], pooling, normalize, config["max_position_embeddings"])
    else:
        eos = [IM_END_ID, ENDOFTEXT_ID]
        _write_json(out / "generation_config.json", {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": eos})
    if tokenizer:
        from portaserve.models.tokenizer_files import write_qwen2_tokenizer

        write_qwen2_tokenizer(out, template="qwen3" if arch == "Qwen3ForCausalLM" else "chatml")
    return out


# The writers the plugin hook registers: writer(out_dir, size, seed) -> None.


def write_llama(out_dir: str, size: str = "tiny", seed: int = 0, **kwargs: Any) -> None:
    write_checkpoint("LlamaForCausalLM", size, out_dir, seed, **kwargs)


def write_qwen2(out_dir: str, size: str = "tiny", seed: int = 0, **kwargs: Any) -> None:
    write_checkpoint("Qwen2ForCausalLM", size, out_dir, seed, **kwargs)


def write_qwen3(out_dir: str, size: str = "tiny", seed: int = 0, **kwargs: Any) -> None:
    write_checkpoint("Qwen3ForCausalLM", size, out_dir, seed, **kwargs)


def write_mistral(out_dir: str, size: str = "tiny", seed: int = 0, **kwargs: Any) -> None:
    write_checkpoint("MistralForCausalLM", size, out_dir, seed, **kwargs)


def write_bert(out_dir: str, size: str = "tiny", seed: int = 0, **kwargs: Any) -> None:
    write_checkpoint("BertModel", size, out_dir, seed, **kwargs)
