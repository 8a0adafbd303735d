"""Build a checkpoint's model under a CPU plan with a given quantization and read its
logits for whole prompts, through the real engine step path (tests/models/model_harness.py:
Scheduler + BlockManager -> ModelRunner)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
import model_harness  # noqa: E402

BLOCK_SIZE = 8


def make_plan(model_dir: str, **config):
    return model_harness.make_plan(model_dir, block_size=BLOCK_SIZE, **config)


@dataclass
class Loaded:
    engine: model_harness.Engine

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    @property
    def plan(self):
        return self.engine.core.spec.plan


def load_model(model_dir: str, **config) -> Loaded:
    """The model on the CPU behind an EngineCore; `config` goes to EngineConfig (dtype, quantization, ...)."""
    return Loaded(model_harness.engine(model_dir, block_size=BLOCK_SIZE, **config))


def prompt_logits(loaded: Loaded, prompt: Sequence[int]) -> torch.Tensor:
    """float32 logits [len(prompt), vocab] of one prompt, prefilled in one step."""
    return model_harness.prompt_logits(loaded.engine, [prompt])[0]


def linear_layers(model):
    """(name, module) of every linear layer a QuantMethod owns (the LM head, never
    quantized, is not one)."""
    from portaserve.models.layers.embedding import ParallelLMHead

    return [
        (n, m) for n, m in model.named_modules()
        if getattr(m, "quant_method", None) is not None and not isinstance(m, ParallelLMHead)
    ]


def layer_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
