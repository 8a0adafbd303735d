"""Engine-level fixtures: tiny checkpoints (with the real Qwen2 tokenizer) and engines
shared per module, since building one costs seconds."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def engine_checkpoint(tmp_path_factory):
    from portaserve.models.checkpoints import write_checkpoint

    made: dict[tuple, str] = {}

    def make(arch: str = "Qwen2ForCausalLM", size: str = "tiny", seed: int = 0, **options) -> str:
        key = (arch, size, seed, tuple(sorted(options.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"engine-{arch}")
            write_checkpoint(arch, size, folder, seed, **options)
            made[key] = str(folder)
        return made[key]

    return make


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
