"""Qwen3: the Llama decoder with an RMSNorm over each head of q and of k (before RoPE),
no qkv bias by default, and Qwen2's sliding-window rules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .llama import DecoderConfig, LlamaForCausalLM
from .qwen2 import windowed_layer_types


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        layer_types, window = windowed_layer_types(hf_config)
        bias = bool(hf_config.get("attention_bias", False))
        return DecoderConfig.from_hf(
            hf_config,
            default_head_dim=128,  # transformers' Qwen3Config default
            default_max_position_embeddings=32768,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            layer_types=layer_types,
            sliding_window=window,
        )
