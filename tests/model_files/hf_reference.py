"""transformers as the reference: greedy decoding by plain argmax over its logits.

Not `generate()`: with `min_new_tokens` it masks the end-of-sequence tokens until the
minimum length, so its "greedy" continuation differs from the argmax wherever the model
would have ended; portaserve's `ignore_eos` keeps the argmax and only does not stop.
"""

from __future__ import annotations

import torch


def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """The `num_tokens` argmax tokens after `prompt_ids`, with transformers' KV cache."""
    out: list[int] = []
    with torch.no_grad():
        step = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(num_tokens):
            token = int(step.logits[0, -1].argmax())
            out.append(token)
            step = model(torch.tensor([[token]]), past_key_values=step.past_key_values, use_cache=True)
    return out
