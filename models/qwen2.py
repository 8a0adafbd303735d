"""Qwen2 / Qwen2.5: the Llama decoder with biases on q, k and v, and optional sliding
windows on the upper layers.

Sliding windows follow transformers' Qwen2Config: they apply only when
`use_sliding_window` is true, to the layers `layer_types` marks "sliding_attention"
(by default the layers from `max_window_layers` on).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .llama import FULL, SLIDING, DecoderConfig, LlamaForCausalLM


def windowed_layer_types(hf_config: Mapping[str, Any]) -> tuple[tuple[str, ...], int | None]:
    """(FULL / SLIDING per layer, window) under the Qwen2/Qwen3 config rules."""
    num_layers = int(hf_config["num_hidden_layers"])
    window = hf_config.get("sliding_window", 4096) if hf_config.get("use_sliding_window", False) else None
    declared = hf_config.get("layer_types")
    if declared is None:
        first_sliding = int(hf_config.get("max_window_layers", 28))
        declared = ["sliding_attention" if window is not None and i >= first_sliding else "full_attention" for i in range(num_layers)]
    if len(declared) != num_layers:
        raise ValueError(f"layer_types: {len(declared)} entries for {num_layers} layers")
    types = tuple(SLIDING if t == "sliding_attention" and window is not None else FULL for t in declared)
    return types, (int(window) if window is not None and SLIDING in types else None)


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_config(cls, hf_config: Mapping[str, Any]) -> DecoderConfig:
        layer_types, window = windowed_layer_types(hf_config)
        return DecoderConfig.from_hf(
            hf_config,
            default_max_position_embeddings=32768,
            qkv_bias=True,
            layer_types=layer_types,
            sliding_window=window,
        )
