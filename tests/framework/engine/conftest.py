"""Engine-level fixtures: transformers' models of the tiny checkpoints (`checkpoint`,
in tests/conftest.py), shared per session since loading one costs seconds."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_model():
    """transformers' model of a folder (float32), cached."""
    import torch
    from transformers import AutoModelForCausalLM

    cache: dict[str, object] = {}

    def load(folder: str):
        if folder not in cache:
            cache[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        return cache[folder]

    return load
