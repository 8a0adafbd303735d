"""Fixtures for model tests: tiny random-weight checkpoints, written once per session.

`checkpoint(arch, **options)` returns the folder of a tiny checkpoint of `arch` (options
go to `write_checkpoint`: config_overrides, dtype, max_shard_bytes, pooling, ...);
identical requests share one folder. Parity tests need no tokenizer, so none is written
unless asked for (`tokenizer=True`).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # model_harness


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from portaserve.models.checkpoints import write_checkpoint

    made: dict[str, str] = {}

    def make(arch: str, size: str = "tiny", seed: int = 0, **options) -> str:
        options.setdefault("tokenizer", False)
        key = json.dumps([arch, size, seed, options], sort_keys=True, default=str)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"{arch}-{size}")
            write_checkpoint(arch, size, folder, seed, **options)
            made[key] = str(folder)
        return made[key]

    return make


@pytest.fixture(autouse=True, scope="session")
def _torch_threads():
    """Two threads: CI machines are small and other suites run alongside."""
    import torch

    torch.set_num_threads(min(2, torch.get_num_threads()))
    yield
