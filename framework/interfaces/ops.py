"""Named ops: declared once with a torch reference, implemented per platform.

An op is a small computation a model calls by name through its LayerContext
(``ctx.ops.get("rms_norm")(x, weight, eps)``). Its `OpSpec` declares the signature and a
plain-torch reference implementation, which is what runs wherever no platform
implementation is bound, so a model that uses an op works on every platform. A platform
contributes faster implementations as `OpImpl`s; the plan binds, per op, the
highest-priority implementation usable on the chosen platform, else the reference, and
lists every binding. The conformance kit compares each contributed implementation with
the reference on the spec's sample inputs.

Ops declared by portaserve itself (:mod:`portaserve.framework.op_references`):

- ``rms_norm(x, weight, eps) -> out``
- ``fused_add_rms_norm(x, residual, weight, eps) -> (out, new_residual)``
- ``silu_and_mul(x: [..., 2 * d]) -> [..., d]``
- ``rotary_embedding(positions, q, k, cos_sin_cache, is_neox) -> (q, k)``
- ``apply_token_bitmask(logits, bitmask) -> logits`` (structured outputs, 1.5)
- ``lora_linear(y, x, lora_a, lora_b, token_slots) -> y`` (LoRA adapters, 1.6)

A plugin declares a new op with ``portaserve_op_specs`` (contract 1.1) and may
implement it, and others' ops, with ``portaserve_custom_ops``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

#: Relative error (||impl - reference|| / ||reference||) the kit accepts by dtype.
DEFAULT_TOLERANCES: Mapping[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _load(target: Callable | str) -> Callable:
    if isinstance(target, str):
        from portaserve.framework.plugins import import_object

        return import_object(target)
    return target


@dataclass(frozen=True, slots=True)
class OpSpec:
    """The declaration of one op: its name, signature, reference and test inputs.

    :param name: the name models call it by; global, like component names.
    :param signature: the call signature and shapes in words, shown by ``portaserve platforms``.
    :param reference: the plain-torch implementation (or ``"module:function"``): the
        numerics every implementation must match, and what runs where none is bound.
    :param sample_inputs: ``(device, dtype, generator) -> list of argument tuples``
        (or ``"module:function"``): inputs the kit runs implementation and reference on;
        tensors are created on `device`, random values drawn from `generator` (a CPU one).
    :param tolerances: relative error accepted per dtype (defaults: DEFAULT_TOLERANCES).
    :param mutates_inputs: True when implementations may write their tensor arguments
        (the kit then passes each its own copies).
    """

    name: str
    signature: str
    reference: Callable | str
    sample_inputs: Callable | str
    tolerances: Mapping[torch.dtype, float] = field(default_factory=dict)
    mutates_inputs: bool = False

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"op name {self.name!r} is not an identifier")

    def load_reference(self) -> Callable:
        return _load(self.reference)

    def samples(self, device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> Sequence[tuple[Any, ...]]:
        return _load(self.sample_inputs)(device, dtype, generator)

    def tolerance(self, dtype: torch.dtype) -> float:
        return self.tolerances.get(dtype, DEFAULT_TOLERANCES.get(dtype, 1e-2))


@dataclass(frozen=True, slots=True)
class OpImpl:
    """One implementation of a declared op.

    The op must be declared (by portaserve or any loaded plugin); an implementation of
    an undeclared op is reported against its plugin and dropped.
    """

    op: str
    name: str  # e.g. "triton"
    platforms: frozenset[str]
    fn: Callable | str  # the function, or "module:function" imported when first bound
    required_features: frozenset[str] = frozenset()
    priority: int = 0  # higher wins among those that qualify
    #: False for an op torch.compile cannot trace (a ctypes call, say): the plan leaves it
    #: unbound when compiling, and the compiled graph fuses the reference instead.
    traceable: bool = True

    def load(self) -> Callable:
        return _load(self.fn)


#: The plan's binding name for an op that runs its reference implementation.
REFERENCE = "reference"
#: The ops portaserve itself declares (framework/op_references.py).
OP_NAMES = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "apply_token_bitmask", "lora_linear")
