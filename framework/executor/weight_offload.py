"""Sleep level 2: a model's weights moved to host memory and back.

A layer served by a QuantMethod hands over its own weights (`QuantMethod.release_weights`
and `restore_weights`: a method may keep device state outside its parameters, such as a
repacked copy); every other parameter (embeddings, norms) has its data moved to host
memory and back. The Parameter objects stay, so ties between modules and the loaders'
tags survive a sleep.
"""

from __future__ import annotations

import torch
from torch import nn


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters, each shared one counted once (at its full shape)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


class OffloadedWeights:
    """The weights of one model while they live in host memory."""

    def __init__(self, model: nn.Module) -> None:
        """Move every weight of `model` to host memory; their device storage is freed."""
        self.num_bytes = parameter_bytes(model)
        #: (layer, what its QuantMethod saved), in release order
        self.layers: list[tuple[nn.Module, dict[str, torch.Tensor]]] = []
        #: (parameter, its values) of the parameters no QuantMethod serves
        self.params: list[tuple[nn.Parameter, torch.Tensor]] = []
        released: set[int] = set()
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            own = {id(p) for p in module.parameters(recurse=False)}
            # a parameter shared with a layer already released (a tied LM head) goes once
            if method is not None and own and not own & released:
                self.layers.append((module, method.release_weights(module)))
                released |= own
        for param in model.parameters():
            if id(param) not in released:
                self.params.append((param, param.data.to("cpu", copy=True)))
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                released.add(id(param))

    def restore(self) -> int:
        """Put every weight back on its device; returns the bytes restored."""
        for param, host in self.params:
            param.data = host.to(param.device)
        for module, saved in reversed(self.layers):
            module.quant_method.restore_weights(module, saved)
        self.layers, self.params = [], []
        return self.num_bytes
