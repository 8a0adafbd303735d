"""A test-only logits processor (``--logits-processors faulty_processor:FailAtStep``) that
fails the request it runs for once that request has generated `FAIL_AT` tokens: raising
an exception, or (for `NaNAtStep`) writing NaN logits. Requests that stop sooner are
untouched, so one server holds failing and healthy requests side by side."""

from __future__ import annotations

import torch

FAIL_AT = 4


class FailAtStep:
    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_ids) == FAIL_AT:
            raise RuntimeError(f"this processor fails after {FAIL_AT} tokens")
        return logits


class NaNAtStep:
    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_ids) == FAIL_AT:
            return torch.full_like(logits, float("nan"))
        return logits
