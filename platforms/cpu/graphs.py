"""CpuGraphs: decode graphs on the CPU, the platform's `GraphCapture` ("cpu_graphs").

A decode step of a small model is a few hundred calls of the C kernels (native.py), each
a few microseconds of math wrapped in as much Python again: module calls, argument
checks, tensor allocation, the ctypes call. For SmolLM2-135M that Python was half of a
token's 10.9 ms. CUDA graphs remove the same overhead on GPUs by recording the kernel
launches of one step and replaying them; this does that for the C kernels:

- `capture(fn)` runs the step once eagerly while every kernel call is recorded (its id
  and its arguments, pointers included) and a torch dispatch mode watches the aten ops.
  Ops that only allocate or view (`empty`, `view`, `slice`, ...) are allowed, and every
  tensor they produce is kept alive with the recording, so each pointer stays valid. Any
  op that computes (an `index_copy_`, a `.item()`, a oneDNN matmul) means the step does
  work a replay would skip, so capture raises `GraphCaptureUnsupported` and the engine
  keeps that batch size eager. Non-recordable entry points refuse the same way.
- The recording then replays once, and its output must equal the eager output bit for
  bit (the kernels are deterministic at a fixed thread count); otherwise it is refused.
- `replay()` is one ctypes call of `ps_graph_replay` (graph_replay.c), which makes the
  recorded calls in order with no Python between them.

The engine copies each step's inputs and attention metadata into the tensors the
recording points at (`DecodeGraphForward`), as for CUDA graphs.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from portaserve.framework.interfaces.graph_capture import GraphCapture, GraphCaptureUnsupported

from . import native

from .platform import CPU_GRAPHS  # noqa: F401  (the compile backend name of these graphs)

#: native entry points a graph may call, by the id graph_replay.c's switch knows them by
KERNEL_IDS = {
    "paged_decode": 1,
    "rms_norm": 2,
    "silu_and_mul": 3,
    "rotary": 4,
    "gguf_matmul": 5,
    "gguf_dequantize": 6,
    "gguf_embedding": 7,
    "kv_write": 8,
}
#: entry points that only compute a size or report a feature: called as usual
QUERIES = frozenset({"workspace_floats", "scratch_floats", "fused_workspace_floats", "gguf_vnni"})
MAX_ARGS = 24

#: aten ops that allocate or view and compute nothing: allowed while recording
NO_COMPUTE = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
        "view", "_unsafe_view", "reshape", "as_strided", "alias", "detach",
        "slice", "select", "split", "split_with_sizes", "unbind", "chunk", "narrow",
        "unsqueeze", "squeeze", "t", "transpose", "permute", "expand", "flatten", "unflatten",
        "lift_fresh",
    )
    if hasattr(torch.ops.aten, name)
)


class _Op(ctypes.Structure):
    """graph_replay.c's ps_graph_op: a kernel id and its arguments, one int64 slot each."""

    _fields_ = [("kernel", ctypes.c_int64), ("a", ctypes.c_int64 * MAX_ARGS)]


def _slot(value: Any, argtype: Any) -> int:
    """One argument as its int64 slot: a float's bits, a pointer's address (None is 0)."""
    if argtype is ctypes.c_float:
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]
    if value is None:
        return 0
    return int(value)


class _WatchOps(TorchDispatchMode):
    """Refuses aten ops that compute; keeps every tensor produced while recording alive."""

    def __init__(self) -> None:
        super().__init__()
        self.keep: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # `.to()` / `.contiguous()` of a tensor already so return it: nothing computed
        identity = bool(args) and out is args[0]
        if func.overloadpacket not in NO_COMPUTE and not identity:
            raise GraphCaptureUnsupported(f"the step runs {func}, which a CPU graph cannot replay")
        self.keep.extend(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


class CpuGraph:
    """One recording: the kernel calls of one step and the tensors their pointers need."""

    def __init__(self, kernels: native.NativeKernels, calls: list[tuple[int, list[int]]], keep: list[torch.Tensor]) -> None:
        self.kernels = kernels
        self.ops = (_Op * max(len(calls), 1))()
        for i, (kernel, slots) in enumerate(calls):
            self.ops[i].kernel = kernel
            self.ops[i].a[: len(slots)] = slots
        self.num_ops = len(calls)
        self.names = {v: k for k, v in KERNEL_IDS.items()}
        self.kinds = [kernel for kernel, _ in calls]
        self.keep = keep  # the pointers' owners: freed with the recording

    def replay(self) -> None:
        rc = self.kernels.graph_replay(ctypes.addressof(self.ops), self.num_ops)
        if rc != 0:
            index = abs(rc) // 1000 - 1 if rc > 0 else -rc - 1
            name = self.names.get(self.kinds[index], "?") if 0 <= index < self.num_ops else "?"
            raise RuntimeError(f"CPU graph replay failed at call {index} ({name}): code {rc}")


class CpuGraphs(GraphCapture):
    """Records the C kernel calls of a decode step (see the module docstring)."""

    #: Every size up to 8, unpadded: a padded row costs ~1.5 ms of matmuls per step for
    #: SmolLM2 here, as much as the Python a recording saves. Past a few decodes the step
    #: is matmul-bound anyway (from 12 rows it switches to oneDNN, which a recording
    #: cannot replay), and every recording keeps its own activations alive.
    batch_sizes = tuple(range(1, 9))

    def __init__(self, kernels: native.NativeKernels | None) -> None:
        self.kernels = kernels

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[CpuGraph, torch.Tensor]:
        if self.kernels is None:
            raise GraphCaptureUnsupported(f"the CPU's C kernels are not available ({native.unavailable_reason()})")
        calls: list[tuple[int, list[int]]] = []
        originals = {}
        for name in native.entry_points():
            originals[name] = getattr(self.kernels, name)
            setattr(self.kernels, name, self._recording(name, originals[name], calls))
        watch = _WatchOps()
        try:
            with watch:
                out = fn()
        finally:
            for name, fn_ in originals.items():
                setattr(self.kernels, name, fn_)
        if not isinstance(out, torch.Tensor):
            raise GraphCaptureUnsupported(f"the step returned {type(out).__name__}, not one tensor")
        graph = CpuGraph(self.kernels, calls, [*watch.keep, out])
        expected = out.clone()
        graph.replay()
        if not torch.equal(out, expected):
            raise GraphCaptureUnsupported("replaying the recorded kernels did not reproduce the eager step")
        return graph, out

    @staticmethod
    def _recording(name: str, fn: Any, calls: list[tuple[int, list[int]]]) -> Callable[..., Any]:
        if name in QUERIES:
            return fn
        kernel = KERNEL_IDS.get(name)
        if kernel is None:
            def refuse(*args: Any) -> Any:
                raise GraphCaptureUnsupported(f"the step calls the C entry point {name}, which a CPU graph cannot replay")
            return refuse
        argtypes = fn.argtypes

        def record(*args: Any) -> Any:
            rc = fn(*args)
            if rc == 0:  # a failing call raises in its caller: nothing to replay
                calls.append((kernel, [_slot(a, t) for a, t in zip(args, argtypes)]))
            return rc

        return record


def cpu_graphs() -> CpuGraphs:
    """The recorder (which refuses every capture where the C kernels failed to build)."""
    return CpuGraphs(native.load())
