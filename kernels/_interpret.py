"""Helpers for running the Triton kernels under the interpreter (`TRITON_INTERPRET=1`).

The interpreter runs every program of a grid in numpy on the host: it is how the kernels
are tested on machines without a GPU. Triton reads the variable when a kernel is
decorated, so it must be set before the kernel modules are imported.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np


def interpreting() -> bool:
    """True when Triton kernels run through the interpreter rather than a compiler."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@contextlib.contextmanager
def interpreter_env() -> Iterator[None]:
    """`TRITON_INTERPRET=1` inside the block, the previous value restored after.

    Tests import triton and the kernel modules inside it (decoration reads the variable,
    triton's own library included) and set it again around each test (triton reads it at
    launch too), so it does not leak into the rest of a test session, e.g. into
    subprocesses other tests start. Raises RuntimeError when triton had already been
    imported without it: its library functions are then compiled-mode and cannot run
    inside interpreted kernels.
    """
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
        if not _triton_library_interpreted():
            raise RuntimeError(
                "triton was imported before TRITON_INTERPRET=1 was set; import it (and the kernels) "
                "inside interpreter_env(), or set TRITON_INTERPRET=1 before the process starts"
            )
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _triton_library_interpreted() -> bool:
    """Whether triton's own jit library was decorated in interpreter mode (True if unimported)."""
    import sys

    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return True
    return type(standard.cdiv).__name__ == "InterpretedFunction"


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

    def create_dot(self, a, b, *args, **kwargs):
        return original(self, as_float32(a), as_float32(b), *args, **kwargs)

    create_dot._portaserve_bf16_fix = True
    builder.create_dot = create_dot
