"""The `QuantMethod` interface: how a linear layer stores its weight and multiplies.

Every linear layer of every model owns one QuantMethod instance, chosen in the
ExecutionPlan. The method creates the layer's parameters (so the loader knows what
checkpoint tensors to expect), post-processes them once after loading (quantize,
repack for a kernel) and applies the layer to an input. Methods are gated by the
platform's declared features, never by a vendor name or an SM number.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn


class QuantMethod(ABC):
    """Weight storage and matmul of one linear layer."""

    name: ClassVar[str]
    #: Platform names this method runs on; None means every platform.
    platforms: ClassVar[frozenset[str] | None] = None
    #: Platform features required (e.g. "fp8_matmul"); see PlatformCapabilities.features.
    required_features: ClassVar[frozenset[str]] = frozenset()
    #: Activation dtypes the method accepts.
    supported_act_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset(
        {torch.float32, torch.bfloat16, torch.float16}
    )
    #: A platform-specific implementation of another method's numerics declares that
    #: method's name here (e.g. "none" for a repacked-weight matmul). The plan then picks
    #: the highest-`variant_priority` usable variant in place of the method it implements,
    #: and says so in the plan's reason.
    variant_of: ClassVar[str | None] = None
    variant_priority: ClassVar[int] = 0
    #: False when `apply` cannot be traced by torch.compile (an opaque packed weight);
    #: such a variant is skipped when the plan compiles the model.
    traceable: ClassVar[bool] = True
    #: The chosen platform's declared features, set on each instance by the LayerContext
    #: (a method may pick a variant by them, e.g. an fp8 flavour).
    platform_features: frozenset[str] = frozenset()

    @classmethod
    def unsupported_reason(
        cls, features: frozenset[str], act_dtype: torch.dtype, config: Mapping[str, Any]
    ) -> str | None:
        """Why the method cannot run on a platform declaring `features` with activations in
        `act_dtype` (and, for a checkpoint format, this `quantization_config`), or None.

        The plan calls it before any weights load. The default checks `required_features`
        and `supported_act_dtypes`; a method whose needs depend on the config (a format
        that dispatches by scheme) or that accepts one of several features overrides it.
        """
        missing = cls.required_features - features
        if missing:
            return f"needs platform features {sorted(missing)}"
        if act_dtype not in cls.supported_act_dtypes:
            return f"does not accept activations in {str(act_dtype).removeprefix('torch.')}"
        return None

    def __init__(self, config: dict | None = None) -> None:
        #: The checkpoint's `quantization_config` (pre-quantized) or None (online / none).
        self.config = config or {}

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        bias: bool,
    ) -> None:
        """Register the layer's parameters (names the checkpoint uses: `weight`, `bias`, scales).

        :param input_size: input features held by this rank.
        :param output_size: output features held by this rank.
        """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn loaded checkpoint tensors into the form `apply` uses (quantize, repack)."""

    def checkpoint_layout(self, layer: nn.Module, param_name: str) -> torch.Tensor | None:
        """The current values of `layer.<param_name>` in the layout `create_weights` gave it
        (the one the checkpoint loader writes), for a parameter that
        `process_weights_after_loading` transformed (quantized, repacked); None when the
        parameter still has that layout.

        A live weight update loads the new values into this tensor, makes it the
        parameter's data and calls `process_weights_after_loading` again, so a method
        that returns a tensor here must accept that second call (and keep the parameter's
        loader tags, `weight_loader`, `output_dim`, ..., on what it registers).
        """
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Compute `x @ W^T (+ bias)`.

        :param x: [..., input_size]
        :returns: [..., output_size]
        """

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes the layer's weights occupy after processing (for memory reports)."""
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False)) + sum(
            b.numel() * b.element_size() for b in layer.buffers(recurse=False)
        )
