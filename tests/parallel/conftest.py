"""Fixtures for the parallel-execution tests: tiny float32 checkpoints (different seeds
give different weights) and cached TP=1 reference outputs; engines are kept small for a
2-core CI machine (a fixed, small KV cache; short steps)."""

from __future__ import annotations

import pytest

from .util import ENGINE_KW, generate_ids


@pytest.fixture(autouse=True)
def _few_threads(monkeypatch):
    # spawned workers inherit this: 2 ranks on 2 cores must not oversubscribe
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def checkpoint(checkpoint):
    """The session `checkpoint` (tests/conftest.py), tiny and float32, seed second:
    `checkpoint(arch, seed, **options)`."""

    def make(arch: str = "Qwen2ForCausalLM", seed: int = 0, **options) -> str:
        return checkpoint(arch, "tiny", seed, dtype="float32", **options)

    return make


@pytest.fixture(scope="session")
def reference_ids(checkpoint):
    """TP=1 greedy outputs of a checkpoint, cached: (arch, seed, options) -> token ids."""
    from portaserve import LLM

    cache: dict[tuple, list[list[int]]] = {}

    def get(prompts, max_tokens: int = 8, arch: str = "Qwen2ForCausalLM", seed: int = 0, **options):
        key = (repr(prompts), max_tokens, arch, seed, repr(sorted(options.items())))
        if key not in cache:
            llm = LLM(checkpoint(arch, seed, **options), **ENGINE_KW)
            try:
                cache[key] = generate_ids(llm, prompts, max_tokens)
            finally:
                llm.shutdown()
        return cache[key]

    return get

