"""Prompts and helpers the speculative decoding tests share (n-gram and draft model)."""

from __future__ import annotations

import random


def repetitive_prompts(count: int, seed: int) -> list[dict]:
    """Prompts with repeated phrases (the proposer finds matches) and plain random ones."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if i % 3 == 2:
            out.append({"prompt_token_ids": [rng.randrange(100, 5000) for _ in range(rng.randrange(5, 30))]})
        else:
            phrase = [rng.randrange(100, 5000) for _ in range(rng.randrange(3, 7))]
            out.append({"prompt_token_ids": phrase * rng.randrange(2, 5) + phrase[:2]})
    return out


def run(llm, prompts, params) -> list:
    return llm.generate(prompts, params, use_tqdm=False)


def ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]
