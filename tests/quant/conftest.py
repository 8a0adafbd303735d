"""Fixtures for the quantization and compilation tests: tiny checkpoints written once per
session (a float32 Qwen2 and a Llama with untied embeddings), two torch threads."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # quant_harness


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from portaserve.models.checkpoints import write_checkpoint

    made: dict[tuple, str] = {}

    def make(arch: str = "Qwen2ForCausalLM", size: str = "tiny", seed: int = 0, **options) -> str:
        options.setdefault("tokenizer", False)
        key = (arch, size, seed, tuple(sorted(options.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"quant-{arch}-{size}")
            write_checkpoint(arch, size, folder, seed, **options)
            made[key] = str(folder)
        return made[key]

    return make


@pytest.fixture(autouse=True, scope="session")
def _torch_threads():
    import torch

    torch.set_num_threads(min(2, torch.get_num_threads()))
    yield
