"""Quant-method checks: a `QuantMethod` against the float linear layer it stands for.

`check_quant_method` builds a bare layer the way a model does (`create_weights` under
the device, the checkpoint tensors of `QuantMethod.conformance_weights` copied into the
parameters it registered, `process_weights_after_loading`), then compares `apply` on
random inputs of a few leading shapes with `F.linear(x, W, b)` in float64, where W is
the float weight the checkpoint stands for: relative error within the method's
`conformance_tolerance` (None: the activation dtype's rounding). A method that stores
embedding tables (`QuantMethod.quantizes_embedding`) also has its `embedding` rows
compared with the table's.

A method that keeps the interface's default `conformance_weights` (a float `weight` and
`bias`) but registers other checkpoint tensors (a pre-quantized format) cannot be fed
by the kit: it is skipped with that reason. A method that overrides it is held to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from portaserve.framework.interfaces import QuantMethod
from portaserve.framework.interfaces.ops import DEFAULT_TOLERANCES
from portaserve.framework.testing.attention_checks import relative_error

#: (input_size, output_size, bias) of the layers built; sizes multiples of 128 that no
#: kernel should refuse, one square-ish with a bias and one wide without.
LAYER_SHAPES = ((256, 384, True), (512, 128, False))
#: Leading shapes of the inputs: one token, a few tokens, a [batch, tokens] block.
INPUT_SHAPES = ((1,), (7,), (2, 5))


class NotCheckable(Exception):
    """The method's checkpoint cannot be built from the default `conformance_weights`."""


def declares_conformance_weights(cls: type[QuantMethod]) -> bool:
    return cls.conformance_weights.__func__ is not QuantMethod.conformance_weights.__func__


def tolerance(cls: type[QuantMethod], dtype: torch.dtype) -> float:
    return cls.conformance_tolerance if cls.conformance_tolerance is not None else DEFAULT_TOLERANCES.get(dtype, 1e-2)


def _load(layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy the checkpoint tensors into the parameters `create_weights` registered."""
    for name, param in layer.named_parameters(recurse=False):
        if getattr(param, "derived_after_loading", False):
            continue  # computed after loading, not read from a checkpoint
        given = tensors.get(name)
        if given is None:
            raise NotCheckable(f"create_weights registered {name!r} {tuple(param.shape)} {param.dtype}, "
                               "which conformance_weights does not provide")
        if tuple(given.shape) != tuple(param.shape) or given.dtype != param.dtype:
            raise NotCheckable(f"create_weights registered {name!r} as {tuple(param.shape)} {param.dtype}; "
                               f"conformance_weights gives {tuple(given.shape)} {given.dtype}")
        param.data.copy_(given.to(param.device))


def _first_clause(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).split("; ", 1)[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_quant_method(cls: type[QuantMethod], device: torch.device, dtype: torch.dtype,
                       features: frozenset[str] = frozenset(), seed: int = 0) -> str | None:
    """Run the comparison; returns why the method was not checkable (None: checked).

    :raises AssertionError: on a wrong output shape, dtype or value.
    """
    strict = declares_conformance_weights(cls)
    tol = tolerance(cls, dtype)
    for n, (input_size, output_size, bias) in enumerate(LAYER_SHAPES):
        gen = torch.Generator().manual_seed(seed + n)
        tensors = cls.conformance_weights(input_size, output_size, dtype, gen)
        method = cls()
        method.platform_features = frozenset(features)
        method.prefix = f"conformance.linear{n}"
        layer = nn.Module()
        try:
            with torch.device(device):
                method.create_weights(layer, input_size, output_size, dtype, bias)
            if not hasattr(layer, "bias"):
                layer.bias = None
            _load(layer, tensors)
        except (NotCheckable, ValueError) as exc:
            # ValueError: create_weights refused (a format that needs a checkpoint's config).
            if strict:
                raise AssertionError(f"{cls.name}: its conformance_weights do not load: {exc}") from exc
            return (f"{cls.name}: its checkpoint is not a plain float weight ({_first_clause(exc)}); a method "
                    "implements QuantMethod.conformance_weights to have the kit check it")
        method.process_weights_after_loading(layer)
        weight = tensors["reference_weight" if "reference_weight" in tensors else "weight"].to("cpu", torch.float64)
        b = tensors["bias"].to("cpu", torch.float64) if bias else None
        for lead in INPUT_SHAPES:
            x = torch.randn(*lead, input_size, generator=gen).to(dtype)
            y = method.apply(layer, x.to(device), layer.bias)
            where = f"{cls.name} [{input_size} -> {output_size}, bias={bias}] x {tuple(x.shape)} {dtype}"
            assert tuple(y.shape) == (*lead, output_size) and y.dtype == dtype, (
                f"{where}: output {tuple(y.shape)} {y.dtype}, expected {(*lead, output_size)} {dtype}")
            err = relative_error(y, F.linear(x.double(), weight, b))
            assert err <= tol, (
                f"{where}: relative error {err:.3g} > {tol:g} against F.linear on the float weight "
                f"(a quantizing method states its error budget in QuantMethod.conformance_tolerance)")
    _check_embedding(cls, device, dtype, features, seed)
    return None


def _check_embedding(cls: type[QuantMethod], device: torch.device, dtype: torch.dtype, features: frozenset[str],
                     seed: int) -> None:
    """A method that stores embedding tables (contract 1.2): `embedding` returns the rows
    of the table it stands for, and `apply` on the same layer multiplies by it (a tied
    LM head)."""
    method = cls()
    method.platform_features = frozenset(features)
    method.prefix = "conformance.embed_tokens"
    if not method.quantizes_embedding():
        return
    rows, dim = 97, 256
    tensors = cls.conformance_weights(dim, rows, dtype, torch.Generator().manual_seed(seed + 100))
    layer = nn.Module()
    with torch.device(device):
        method.create_weights(layer, dim, rows, dtype, False)
    _load(layer, tensors)
    method.process_weights_after_loading(layer)
    table = tensors["reference_weight" if "reference_weight" in tensors else "weight"].to("cpu", torch.float64)
    ids = torch.tensor([0, rows - 1, 5, 5, 42])
    out = method.embedding(layer, ids.to(device))
    assert tuple(out.shape) == (len(ids), dim) and out.dtype == dtype, (
        f"{cls.name}: embedding rows {tuple(out.shape)} {out.dtype}, expected {(len(ids), dim)} {dtype}")
    # the rows are stored values, not products: only the dtype's rounding
    err = relative_error(out, table[ids])
    assert err <= DEFAULT_TOLERANCES.get(dtype, 1e-2), f"{cls.name}: embedding rows off by {err:.3g} ({dtype})"
