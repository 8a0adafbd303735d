"""Helpers for running the Triton kernels under the interpreter (`TRITON_INTERPRET=1`).

The interpreter runs every program of a grid in numpy on the host: it is how the kernels
are tested on machines without a GPU. Triton reads the variable when a kernel is
decorated, so it must be set before the kernel modules are imported.
"""

from __future__ import annotations

import os

import numpy as np


def interpreting() -> bool:
    """True when Triton kernels run through the interpreter rather than a compiler."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fix_interpreter_bf16_dot() -> None:
    """Make the interpreter's `tl.dot` compute bfloat16 operands as numbers.

    The interpreter stores bfloat16 as raw uint16 and (triton 3.x) hands those integers
    straight to numpy's matmul, so a bf16 `tl.dot` returns garbage there while it is
    correct on every GPU backend. Upcasting both operands to float32 (exact for bf16)
    inside the interpreter alone keeps the kernels' GPU code path unchanged.
    Idempotent; a no-op when not interpreting or when triton's layout differs.
    """
    if not interpreting():
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or getattr(original, "_portaserve_bf16_fix", False):
        return
    handle_cls = interpreter.TensorHandle

    def as_float32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << np.uint32(16)
        return handle_cls(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, as_float32(a), as_float32(b), d, input_precision, max_num_imprecise_acc)

    create_dot._portaserve_bf16_fix = True
    builder.create_dot = create_dot
