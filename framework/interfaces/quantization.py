"""The `QuantMethod` interface: how a linear layer stores its weight and multiplies.

Every linear layer of every model owns one QuantMethod instance, chosen in the
ExecutionPlan. The method creates the layer's parameters (so the loader knows what
checkpoint tensors to expect), post-processes them once after loading (quantize,
repack for a kernel) and applies the layer to an input. Methods are gated by the
platform's declared features, never by a vendor name or an SM number.

Loader conventions (what the models' layers and checkpoint loader expect):

- Parameters are registered on the layer under the checkpoint's names (`weight`,
  `bias`, `weight_scale`, ...); the loader fills each from the tensor of that name.
- After `create_weights`, the layer sets `param.weight_loader(param, loaded,
  shard_id=None)` on every parameter it finds: it cuts this rank's shard of the full
  checkpoint tensor `loaded` (and, for a fused layer, the `shard_id` part: "q"/"k"/"v" or
  the index of a merged sub-layer) into `param`. A method never sets it itself.
- `param.output_dim` / `param.input_dim`: the dimension of `param` that is split with
  the layer's outputs / inputs under tensor parallelism (vLLM's convention). Untagged
  parameters get the unquantized layout: a 2-D `[out, in]` tensor splits on both, a 1-D
  `[out]` one with the outputs; other shapes (per-tensor scales) are replicated. Tag
  `output_dim = 0` on a per-output-channel scale of shape `[out, 1]`.
- `param.derived_after_loading = True`: the parameter is computed by
  `process_weights_after_loading` (online quantization's scales), not read from the
  checkpoint, so the loader does not expect a tensor for it.
- A method that replaces parameters in `process_weights_after_loading` copies these tags
  (`weight_loader`, `output_dim`, ...) onto the new ones, so a live weight update loads
  through them as the checkpoint did.
- Instance attributes the engine sets before `create_weights`: `prefix` (the layer's
  name, e.g. "model.layers.0.mlp.down_proj", for messages and per-layer schemes) and
  `platform_features`.
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
    #: The layer's name ("model.layers.0.mlp.down_proj"), set on each instance by the
    #: LayerContext before `create_weights`.
    prefix: str = ""

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

        Tag them for the loader as the module docstring says (`output_dim`, `input_dim`,
        `derived_after_loading`); the layer adds `weight_loader`.

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

    def quantizes_embedding(self) -> bool:
        """Whether this method also stores the embedding table at `self.prefix` (contract 1.2).

        The default is False: embedding tables (and an LM head tied to one) stay dense in
        the model dtype. A method that returns True gets `create_weights(layer,
        input_size=embedding_dim, output_size=rows, ...)` from the embedding layer (and
        from an untied LM head, which then multiplies through `apply`), and must
        implement `embedding`. A format whose file quantizes the table (GGUF) uses this
        to keep it quantized in memory.
        """
        return False

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` ([num_tokens] int64, each in [0, rows)) of the table stored on `layer`,
        as [num_tokens, embedding_dim] in the activation dtype (contract 1.2; only called
        when `quantizes_embedding()` is True)."""
        raise NotImplementedError(f"{type(self).__name__} does not store embedding tables")

    def release_weights(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        """Free the device memory of the layer's weights (`sleep(level=2)`); returns what
        `restore_weights` rebuilds them from: host (CPU) tensors by parameter name.

        The layer's Parameter objects must stay (with their loader tags, and tied to any
        other module that shares them); only their data goes, replaced by empty tensors
        on the same device. The default moves each parameter's data to host memory as it
        is; a method that keeps device state outside its parameters (a packed copy
        behind a placeholder) overrides both methods to drop and rebuild that too.
        """
        saved = {}
        for name, param in layer.named_parameters(recurse=False):
            saved[name] = param.data.to("cpu", copy=True)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        return saved

    def restore_weights(self, layer: nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
        """Undo `release_weights` (`wake_up`): put `saved` (its return value) back on each
        parameter's device, in the form `apply` uses."""
        for name, host in saved.items():
            param = getattr(layer, name)
            param.data = host.to(param.device)

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes the layer's weights occupy after processing (for memory reports)."""
        return sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False)) + sum(
            b.numel() * b.element_size() for b in layer.buffers(recurse=False)
        )

    # ----- what the conformance kit checks (framework/testing/test_quant_methods.py) ----

    #: Relative error ‖y − F.linear(x, W, b)‖ / ‖F.linear(x, W, b)‖ the conformance kit
    #: accepts, W being the float weight the layer was loaded from. None: the activation
    #: dtype's rounding (1e-5 float32, 2e-3 float16, 1e-2 bfloat16), right for a method
    #: that keeps float weights; a quantizing method states its error budget here.
    conformance_tolerance: ClassVar[float | None] = None

    @classmethod
    def conformance_weights(
        cls, input_size: int, output_size: int, dtype: torch.dtype, generator: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """Checkpoint tensors the conformance kit loads into a layer, by parameter name.

        The kit calls `create_weights` (with and without bias), copies into each
        parameter it registered the tensor of that name (same shape and dtype), runs
        `process_weights_after_loading`, and compares `apply` on random inputs with
        `F.linear(x, reference_weight, bias)` within `conformance_tolerance`. The entry
        "reference_weight" ([output_size, input_size], float) is the weight the reference
        multiplies by; without it, "weight" is.

        The default is a float checkpoint: "weight" [output_size, input_size] and "bias"
        [output_size] in `dtype`, drawn from `generator` (a CPU one). A method whose
        checkpoint holds other tensors (a pre-quantized format: int8 / fp8 weights and
        their scales) overrides this to return them and the float weight they stand for;
        otherwise the kit skips it and says why.
        """
        weight = torch.randn(output_size, input_size, generator=generator) / input_size**0.5
        # a bias as large as the product, so a method that drops or misplaces it fails
        bias = 0.5 * torch.randn(output_size, generator=generator)
        return {"weight": weight.to(dtype), "bias": bias.to(dtype)}
