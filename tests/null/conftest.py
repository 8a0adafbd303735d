"""Fixtures for the tests that need no checkpoint on disk."""

from __future__ import annotations

import pytest


@pytest.fixture
def engine_tiny_config():
    """config.json of a tiny Qwen2: enough to resolve an ExecutionPlan without weights."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
        "torch_dtype": "bfloat16",
    }
