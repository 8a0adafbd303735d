"""Custom op implementations a plugin contributes (fused kernels for layers).

Layers call ops by name through their LayerContext (`ctx.ops.rms_norm(...)`); the
plan binds each name to the best implementation registered for the platform, or to
the layer's plain torch version when none is. Op names and signatures:

- `rms_norm(x, weight, eps) -> out`
- `fused_add_rms_norm(x, residual, weight, eps) -> (out, new_residual)`
- `silu_and_mul(x: [..., 2 * d]) -> [..., d]`
- `rotary_embedding(positions, q, k, cos_sin_cache, is_neox) -> (q, k)`
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

OP_NAMES = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")


@dataclass(frozen=True, slots=True)
class OpImpl:
    """One implementation of a named op."""

    op: str
    name: str  # e.g. "triton"
    platforms: frozenset[str]
    fn: Callable | str  # the function, or "module:function" imported when first bound
    required_features: frozenset[str] = frozenset()
    priority: int = 0  # higher wins among those that qualify
    #: False for an op torch.compile cannot trace (a ctypes call, say): the plan leaves it
    #: unbound when compiling, and the compiled graph fuses the layer's torch code instead.
    traceable: bool = True

    def __post_init__(self) -> None:
        if self.op not in OP_NAMES:
            raise ValueError(f"unknown op {self.op!r}; known ops: {', '.join(OP_NAMES)}")

    def load(self) -> Callable:
        if isinstance(self.fn, str):
            from portaserve.framework.plugins import import_object

            return import_object(self.fn)
        return self.fn
