"""Op checks: a contributed implementation against its op's torch reference.

Each `OpSpec` (framework/interfaces/ops.py) brings its reference and sample inputs;
`compare_op` runs both on every sample (each on its own copies when the op may write its
arguments) and compares every output: same structure, shapes and dtypes, and a relative
error ‖impl − ref‖ / ‖ref‖ within `spec.tolerance(dtype)` per output tensor (infinities
must match the reference's exactly, position and sign).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from portaserve.framework.interfaces.ops import OpSpec
from portaserve.framework.testing.attention_checks import relative_error


def _copy(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _flatten(out: Any) -> list[Any]:
    return [x for item in out for x in _flatten(item)] if isinstance(out, (tuple, list)) else [out]


def compare_outputs(name: str, got: Any, want: Any, tolerance: float) -> list[str]:
    """What differs between an implementation's outputs and the reference's."""
    got_items, want_items = _flatten(got), _flatten(want)
    if len(got_items) != len(want_items):
        return [f"{name}: {len(got_items)} outputs, the reference returns {len(want_items)}"]
    problems = []
    for i, (g, w) in enumerate(zip(got_items, want_items)):
        where = f"{name} output {i}"
        if not isinstance(w, torch.Tensor):
            if g != w:
                problems.append(f"{where}: {g!r}, the reference gives {w!r}")
            continue
        if not isinstance(g, torch.Tensor):
            problems.append(f"{where}: {type(g).__name__}, the reference gives a tensor")
        elif tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
            problems.append(f"{where}: {tuple(g.shape)} {g.dtype}, the reference gives {tuple(w.shape)} {w.dtype}")
        elif w.numel():
            # infinities (a mask's -inf) must sit where the reference's do; the rest compares by error
            inf_g, inf_w = torch.isinf(g), torch.isinf(w)
            if inf_w.any() or inf_g.any():
                if not torch.equal(inf_g, inf_w) or not torch.equal(g[inf_g], w[inf_w]):
                    problems.append(f"{where}: infinities differ from the reference's "
                                    f"({int(inf_g.sum())} vs {int(inf_w.sum())})")
                    continue
                g, w = g[~inf_w], w[~inf_w]
                if not w.numel():
                    continue
            err = relative_error(g, w)
            if not err <= tolerance:
                problems.append(f"{where}: relative error {err:.3g} > {tolerance:g}" + (" (NaN/inf)" if math.isinf(err) else ""))
    return problems


def compare_op(impl: Callable, spec: OpSpec, device: torch.device, dtype: torch.dtype, seed: int = 0) -> list[str]:
    """Run `impl` and `spec`'s reference on the spec's samples; returns what was wrong."""
    reference = spec.load_reference()
    samples = spec.samples(device, dtype, torch.Generator().manual_seed(seed))
    if not samples:
        return [f"{spec.name}: sample_inputs gave no inputs for {dtype}"]
    problems = []
    for n, args in enumerate(samples):
        ref_args = _copy(args) if spec.mutates_inputs else args
        # Without mutates_inputs the arguments must come back unchanged: keep copies to check.
        impl_args, before = (_copy(args), None) if spec.mutates_inputs else (args, _copy(args))
        want = reference(*ref_args)
        try:
            got = impl(*impl_args)
        except Exception as exc:
            problems.append(f"{spec.name} sample {n}: raised {type(exc).__name__}: {exc}")
            continue
        problems += compare_outputs(f"{spec.name} sample {n}", got, want, spec.tolerance(dtype))
        if before is not None:
            for i, (a, b) in enumerate(zip(impl_args, before)):
                if isinstance(a, torch.Tensor) and not torch.equal(a, b):
                    problems.append(f"{spec.name} sample {n}: argument {i} was written, but the spec does not "
                                    "declare mutates_inputs")
    return problems
