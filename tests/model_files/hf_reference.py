"""transformers as the reference: greedy decoding by plain argmax over its logits.

Not `generate()`: with `min_new_tokens` it masks the end-of-sequence tokens until the
minimum length, so its "greedy" continuation differs from the argmax wherever the model
would have ended; portaserve's `ignore_eos` keeps the argmax and only does not stop.
Each step runs the whole sequence (no KV cache): slower, but nothing to go stale.
"""

from __future__ import annotations

import torch


def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """The `num_tokens` argmax tokens after `prompt_ids`."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]
