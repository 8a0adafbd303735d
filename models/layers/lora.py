"""A linear layer's LoRA slots: `--max-loras` adapters resident at once, each one's A and B
padded to `--max-lora-rank`.

A fused projection (q/k/v, gate/up) stacks its parts' A matrices along the rank and keeps
B block-diagonal, so the whole layer's term is one `lora_linear` call:
`y += (x A^T) B^T`, A [parts * rank, in], B^T stored as [parts * rank, out] (rows of
outputs, what the expansion reads). Tensor parallelism shards
like the base layer: a column-parallel layer keeps A whole and cuts B's rows as its
weight loader cuts W's; a row-parallel layer cuts A's columns (its input is split), keeps
B whole and adds its partial term before the all-reduce, which sums the parts.
"""

from __future__ import annotations

import torch

#: a fused layer's parts, in output order (the checkpoint's module names)
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: the layers that take adapters (by their last name)
TARGETS = frozenset({"qkv_proj", "gate_up_proj", "o_proj", "down_proj", "q_proj", "k_proj", "v_proj",
                     "gate_proj", "up_proj"})


class LinearLoRA:
    """The adapter slots of one linear layer (see the module docstring)."""

    def __init__(self, layer, state, slices: list[tuple[int, int, int, int]], input_slice: tuple[int, int] | None) -> None:
        """:param slices: per part, (first row of this rank's share in the full B, rows, offset in the layer's
            output, the part's full output size)
        :param input_slice: (first column, columns) of A this rank keeps (row-parallel), None for all"""
        self.state = state
        head, _, leaf = layer.prefix.rpartition(".")
        self.modules = [f"{head}.{part}" for part in FUSED_PARTS.get(leaf, (leaf,))]
        self.slices = slices
        self.input_slice = input_slice
        self.full_input = layer.input_size
        rank, slots = state.max_rank, state.max_loras
        dtype, device = state.dtype, state.device
        layer.register_buffer("lora_a", torch.zeros(slots, len(self.modules) * rank, layer.input_size_per_rank,
                                                     dtype=dtype, device=device), persistent=False)
        layer.register_buffer("lora_b", torch.zeros(slots, len(self.modules) * rank, layer.output_size_per_rank,
                                                     dtype=dtype, device=device), persistent=False)
        self.layer = layer
        state.layers.append(self)

    def shapes(self) -> dict[str, tuple[int, int]]:
        """Checkpoint module name -> (in, out) of the full, unsharded part."""
        return {module: (self.full_input, s[3]) for module, s in zip(self.modules, self.slices)}

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter's parts into `slot` (parts it does not target stay zero)."""
        rank = self.state.max_rank
        a, b = self.layer.lora_a[slot], self.layer.lora_b[slot]
        a.zero_()
        b.zero_()
        for j, (module, (first, rows, offset, _)) in enumerate(zip(self.modules, self.slices)):
            found = weights.get(module)
            if found is None:
                continue
            part_a, part_b = found
            r = part_a.shape[0]
            if self.input_slice is not None:
                part_a = part_a[:, self.input_slice[0]: self.input_slice[0] + self.input_slice[1]]
            a[j * rank: j * rank + r].copy_(part_a)
            b[j * rank: j * rank + r, offset: offset + rows].copy_(part_b[first: first + rows].t())

    def add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        slots = self.state.token_slots
        if slots is None:
            return y
        return self.state.op(y, x, self.layer.lora_a, self.layer.lora_b, slots)


def attach(layer, state) -> LinearLoRA | None:
    """LoRA slots for `layer` when the engine serves adapters and the layer takes them:
    a projection of the architecture's `lora_modules` (a vision tower's are not)."""
    if state is None or layer.prefix.rpartition(".")[2] not in TARGETS:
        return None
    head, _, leaf = layer.prefix.rpartition(".")
    if state.modules is not None and not any(f"{head}.{part}" in state.modules
                                             for part in FUSED_PARTS.get(leaf, (leaf,))):
        return None
    return LinearLoRA(layer, state, layer.lora_slices(), layer.lora_input_slice())
