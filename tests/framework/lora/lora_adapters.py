"""Random-weight PEFT adapters written by `peft` itself, and transformers + peft references."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(base: str, folder: Path, *, seed: int, rank: int = 8, alpha: int = 16,
                  targets=tuple(ALL_PROJECTIONS), use_rslora: bool = False, **extra) -> str:
    """An adapter over `base` with random A and B (peft's init_lora_weights=False), saved by peft."""
    import peft
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                             use_rslora=use_rslora, lora_dropout=0.0, **extra)
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():  # B at a scale that changes greedy outputs without swamping the base
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3)
    wrapped.save_pretrained(str(folder))
    return str(folder)


@functools.lru_cache(maxsize=16)
def _reference(base: str, adapter: str | None):
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    return model.eval()


def reference_greedy(base: str, adapter: str | None, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = _reference(base, adapter).generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
