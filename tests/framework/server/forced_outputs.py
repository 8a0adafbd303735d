"""A test-only logits processor (``--logits-processors forced_outputs:ForceTokens``) that
makes every request generate one fixed token sequence, then its end-of-sequence token.

The ids come from the environment (set before the engine process is spawned), so one
server can be forced to write a tool call or a reasoning block from a random model.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import torch

IDS_VAR = "PORTASERVE_TEST_FORCED_IDS"
EOS_VAR = "PORTASERVE_TEST_FORCED_EOS"


class ForceTokens:
    def __init__(self) -> None:
        self.ids = [int(t) for t in os.environ[IDS_VAR].split(",")]
        self.eos = int(os.environ[EOS_VAR])

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        # logits: [vocab]
        i = len(output_ids)
        target = self.ids[i] if i < len(self.ids) else self.eos
        forced = torch.full_like(logits, float("-inf"))
        forced[target] = 0.0
        return forced


@contextlib.contextmanager
def forcing(ids: Sequence[int], eos: int) -> Iterator[None]:
    """Set the forced ids and EOS for engines started inside (restored afterwards)."""
    saved = {k: os.environ.get(k) for k in (IDS_VAR, EOS_VAR)}
    os.environ[IDS_VAR] = ",".join(map(str, ids))
    os.environ[EOS_VAR] = str(eos)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
