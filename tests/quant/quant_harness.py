"""Build a checkpoint's model under a CPU plan with a given quantization and read its
logits for whole prompts (one prefill step each, a fresh paged KV cache)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from portaserve.framework.checkpoint import load_hf_config
from portaserve.framework.config import EngineConfig
from portaserve.framework.executor.model_builder import build_model
from portaserve.framework.interfaces import AttentionBatch
from portaserve.framework.layer_context import LayerContext, StepContext
from portaserve.framework.plan import resolve_plan
from portaserve.framework.plugins import get_registry
from portaserve.framework.selection import choose_platform

BLOCK_SIZE = 8


def make_plan(model_dir: str, **config):
    registry = get_registry()
    cfg = EngineConfig.create(model=str(model_dir), device=config.pop("device", "cpu"), block_size=BLOCK_SIZE, **config)
    choice = choose_platform(registry, cfg.device)
    return resolve_plan(cfg, registry, choice, load_hf_config(model_dir)), registry


@dataclass
class Loaded:
    model: torch.nn.Module
    plan: object
    registry: object
    hf_config: dict


def load_model(model_dir: str, **config) -> Loaded:
    """The model on the CPU; `config` goes to EngineConfig (dtype, quantization, ...)."""
    plan, registry = make_plan(model_dir, **config)
    model = build_model(plan, registry, model_dir, torch.device("cpu"), progress=False)
    return Loaded(model, plan, registry, load_hf_config(model_dir))


@torch.inference_mode()
def prompt_logits(loaded: Loaded, prompt: Sequence[int]) -> torch.Tensor:
    """float32 logits [len(prompt), vocab] of one prompt, prefilled in one step."""
    model, plan, registry = loaded.model, loaded.plan, loaded.registry
    backends = LayerContext.from_plan(plan, registry, torch.device("cpu")).attention_backends()
    arch = plan.model_class(registry)
    n = len(prompt)
    num_blocks = -(-n // BLOCK_SIZE) + 1
    layer_types = arch.attention_layer_types(loaded.hf_config)
    kv = [torch.zeros(backends[t].kv_cache_shape(num_blocks), dtype=backends[t].kv_cache_torch_dtype()) for t in layer_types]
    blocks = list(range(1, num_blocks))  # block 0 stays unused
    batch = AttentionBatch(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.tensor([blocks], dtype=torch.int32),
        slot_mapping=torch.tensor([blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)], dtype=torch.int64),
        max_query_len=n,
        max_seq_len=n,
        block_size=BLOCK_SIZE,
        num_actual_tokens=n,
    )
    step = StepContext({t: b.build_metadata(batch) for t, b in backends.items()}, kv, batch.query_start_loc)
    hidden = model(torch.tensor(prompt, dtype=torch.long), torch.arange(n), step)
    return model.compute_logits(hidden).float()


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
