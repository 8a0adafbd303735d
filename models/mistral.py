"""Mistral: the Llama decoder with a sliding window on every layer when
`sliding_window` is set (transformers' MistralConfig defaults it to 4096; null turns it off)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .llama import FULL, SLIDING, DecoderConfig, LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        window = hf_config.get("sliding_window", 4096)
        num_layers = int(hf_config["num_hidden_layers"])
        return DecoderConfig.from_hf(
            hf_config,
            default_num_kv_heads=8,  # transformers' MistralConfig default
            default_max_position_embeddings=4096 * 32,
            layer_types=((SLIDING if window is not None else FULL),) * num_layers,
            sliding_window=int(window) if window is not None else None,
        )
