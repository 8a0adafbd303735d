"""The "compressed-tensors" QuantMethod: checkpoints quantized by llm-compressor.

Such a checkpoint's config.json carries a `quantization_config` with
`quant_method: "compressed-tensors"`, a `format`, `config_groups` (each: `targets`, a
`weights` and an `input_activations` description) and `ignore` (layers left in float).
Two schemes are served, both with one scale per output channel:

- W8A16 (int8 weight-only): weights `{num_bits: 8, type: "int", strategy: "channel",
  symmetric: true}`, no input activations; tensors `weight` (int8) and `weight_scale`
  ([out, 1]) -> the "int8" method;
- FP8_DYNAMIC: weights `{num_bits: 8, type: "float", strategy: "channel"}`, input
  activations `{dynamic: true, strategy: "token", type: "float"}`; tensors `weight`
  (float8_e4m3fn) and `weight_scale` -> the "fp8" method (needs "fp8_matmul").

Weights must be stored as they are ("int-quantized", "float-quantized" or
"naive-quantized" formats); int32-packed weights ("pack-quantized") are refused at plan
time, as is anything else, with what is supported instead.

portaserve fuses q/k/v and gate/up projections into one layer; the parts of a fused
layer must share one scheme (llm-compressor quantizes them alike).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from portaserve.framework.errors import UnsupportedError
from portaserve.framework.interfaces import QuantMethod
from portaserve.framework.quantization.unquantized import UnquantizedMethod

from .fp8 import Fp8Method
from .int8 import Int8WeightOnlyMethod

SUPPORTED_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")
SUPPORTED_SCHEMES = "W8A16 (int8 weights, channel scales) and FP8_DYNAMIC (fp8 weights, channel scales, dynamic per-token activations)"
#: portaserve's fused layers -> the checkpoint's (and compressed-tensors' `ignore`) layer names
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_METHODS: dict[str, type[QuantMethod]] = {"int8": Int8WeightOnlyMethod, "fp8": Fp8Method}


def _fail(msg: str) -> UnsupportedError:
    return UnsupportedError(f"quantization: compressed-tensors checkpoint: {msg}; supported: {SUPPORTED_SCHEMES}, "
                            f"formats {', '.join(SUPPORTED_FORMATS)}")


def scheme_method(group_name: str, group: Mapping[str, Any]) -> str:
    """The method ("int8" or "fp8") that serves one config group, or UnsupportedError."""
    w = dict(group.get("weights") or {})
    acts = group.get("input_activations")
    if not w:
        raise _fail(f"group {group_name!r} quantizes no weights")
    if group.get("output_activations"):
        raise _fail(f"group {group_name!r} quantizes output activations")
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    if bits != 8:
        raise _fail(f"group {group_name!r} has {bits}-bit weights")
    if not w.get("symmetric", True):
        raise _fail(f"group {group_name!r} has asymmetric weights (zero points)")
    if strategy != "channel" or w.get("dynamic"):
        raise _fail(f"group {group_name!r} has weight strategy {strategy!r}{' (dynamic)' if w.get('dynamic') else ''}; only 'channel'")
    if kind == "int" and not acts:
        return "int8"
    if kind == "float" and acts:
        a = dict(acts)
        if a.get("dynamic") and a.get("strategy") == "token" and a.get("type") == "float" and a.get("num_bits") == 8:
            return "fp8"
        raise _fail(f"group {group_name!r} has fp8 weights with activations {a}; only dynamic per-token fp8")
    what = "int8 weights with quantized activations (W8A8)" if kind == "int" else "fp8 weights without activation quantization"
    raise _fail(f"group {group_name!r} has {what}")


def parse_config(config: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], str]]:
    """(group name, targets, method) per config group, validating the whole config."""
    fmt = config.get("format")
    if fmt not in SUPPORTED_FORMATS:
        raise _fail(f"format {fmt!r}" + (" packs weights into int32" if fmt == "pack-quantized" else ""))
    if config.get("kv_cache_scheme"):
        raise _fail("a kv_cache_scheme (calibrated KV-cache scales) is not supported; use --kv-cache-dtype fp8 instead")
    if config.get("sparsity_config"):
        raise _fail("sparse weights (sparsity_config) are not supported")
    groups = dict(config.get("config_groups") or {})
    if not groups:
        raise _fail("no config_groups")
    out = []
    for name, group in groups.items():
        if group.get("format", fmt) not in SUPPORTED_FORMATS:
            raise _fail(f"group {name!r} has format {group.get('format')!r}")
        out.append((name, tuple(group.get("targets") or ("Linear",)), scheme_method(name, group)))
    return out


def _matches(target: str, layer_name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], layer_name) is not None
    return target == layer_name


def _part_names(prefix: str) -> tuple[str, ...]:
    head, _, last = prefix.rpartition(".")
    parts = FUSED_PARTS.get(last)
    if parts is None:
        return (prefix,)
    return tuple(f"{head}.{p}" if head else p for p in parts)


class CompressedTensorsMethod(QuantMethod):
    """Dispatches each linear layer to the int8, fp8 or unquantized method by the checkpoint's config."""

    name = "compressed-tensors"

    @classmethod
    def unsupported_reason(cls, features: frozenset[str], act_dtype: torch.dtype, config: Mapping[str, Any]) -> str | None:
        if not config:  # asked in general (the plan's list of supported methods)
            return None
        try:
            groups = parse_config(config)
        except UnsupportedError as exc:
            return str(exc).removeprefix("quantization: ")
        for group, _targets, method in groups:
            why = _METHODS[method].unsupported_reason(features, act_dtype, {})
            if why:
                return f"the checkpoint's group {group!r} runs as {method!r}, which {why}"
        return None

    def __init__(self, config: dict | None = None) -> None:
        super().__init__(config)
        self.groups = parse_config(self.config) if self.config else []
        self.ignore = tuple(self.config.get("ignore") or ())
        self.prefix = ""
        self.delegate: QuantMethod | None = None

    def method_for(self, prefix: str) -> str:
        """"int8", "fp8" or "none" for the layer at `prefix` (every part of a fused layer agrees)."""
        chosen = {self._method_for_part(name) for name in _part_names(prefix)}
        if len(chosen) > 1:
            raise _fail(f"the parts of fused layer {prefix!r} use different schemes {sorted(chosen)}")
        return chosen.pop()

    def _method_for_part(self, name: str) -> str:
        if any(_matches(t, name) for t in self.ignore):
            return "none"
        # a target naming the layer wins over the catch-all class name "Linear"
        for _group, targets, method in self.groups:
            if any(t != "Linear" and _matches(t, name) for t in targets):
                return method
        for _group, targets, method in self.groups:
            if "Linear" in targets:
                return method
        return "none"

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype, bias: bool) -> None:
        if not self.groups:
            raise _fail("the model has no quantization_config (use --quantization int8 or fp8 to quantize online)")
        method = self.method_for(self.prefix)
        delegate = UnquantizedMethod() if method == "none" else _METHODS[method](self.config, prequantized=True)
        delegate.prefix = self.prefix
        delegate.platform_features = self.platform_features
        self.delegate = delegate
        delegate.create_weights(layer, input_size, output_size, params_dtype, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.delegate.process_weights_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.delegate.apply(layer, x, bias)
