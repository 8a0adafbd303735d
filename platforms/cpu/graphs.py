"""CpuGraphs: decode graphs on the CPU, the platform's `GraphCapture` ("cpu_graphs").

A decode step of a small model is a few hundred calls of the C kernels (native.py), each
a few microseconds of math wrapped in as much Python again: module calls, argument
checks, tensor allocation, the ctypes call. For SmolLM2-135M that Python was half of a
token's 10.9 ms. CUDA graphs remove the same overhead on GPUs by recording the kernel
launches of one step and replaying them; this does that for the C kernels:

- `capture(fn)` runs the step once eagerly while every kernel call is recorded (its id
  and its arguments, pointers included) and a torch dispatch mode watches the aten ops.
  Ops that only allocate or view (`empty`, `view`, `slice`, ...) are allowed. New tensors
  are carved from one arena that every recording shares (`Arena`: replays never overlap,
  as CUDA graphs share a memory pool), at most `PORTASERVE_CPU_GRAPH_MEMORY_MB` (256),
  and every tensor is kept alive with the recording, so each pointer stays valid. Any
  op that computes (an `index_copy_`, a `.item()`, a oneDNN matmul) means the step does
  work a replay would skip, so capture raises `GraphCaptureUnsupported` and the engine
  keeps that batch size eager. Non-recordable entry points refuse the same way.
- The first recording then replays once, and its output must equal the eager output bit
  for bit (the kernels are deterministic at a fixed thread count); otherwise it is
  refused. Later recordings (other batch sizes of the same model, the same code) skip
  this: a server records up to 32 of them while it serves.
- `replay()` is one ctypes call of `ps_graph_replay` (graph_replay.c), which makes the
  recorded calls in order with no Python between them.

The engine copies each step's inputs and attention metadata into the tensors the
recording points at (`DecodeGraphForward`), as for CUDA graphs.
"""

from __future__ import annotations

import ctypes
import os
import struct
import weakref
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
    "gguf_gemm": 9,
}
#: entry points that only compute a size or report a feature: called as usual
QUERIES = frozenset({"workspace_floats", "scratch_floats", "fused_workspace_floats", "gguf_vnni", "gguf_gemm_available"})
#: entry points never recorded, refused should a recorded forward call them: the sampler's
#: mask (after the forward) and LoRA (steps that run adapters are eager: the recorded
#: graphs are the base model's)
OUTSIDE_FORWARD = frozenset({"apply_token_bitmask", "lora_linear"})
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


class Arena:
    """The memory every recording's new tensors are carved from, shared by all recordings.

    Replays never overlap (one step at a time), and a recording's intermediates mean
    nothing outside its replay, so each recording allocates from the start of the same
    chunks, like CUDA graphs sharing one memory pool: the memory is the largest
    recording's, not the sum. A recording's output is overwritten by the next replay of
    another; the engine reads it before that (the step's logits)."""

    CHUNK = 8 << 20

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.chunks: list[torch.Tensor] = []
        self.chunk = self.offset = 0

    @property
    def reserved_bytes(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether t's data lies in the arena."""
        p = t.data_ptr()
        return any(c.data_ptr() <= p < c.data_ptr() + c.numel() for c in self.chunks)

    def rewind(self) -> None:
        self.chunk = self.offset = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """nbytes (64-byte aligned) as a uint8 tensor viewing the arena."""
        nbytes = max(64, -(-nbytes // 64) * 64)
        while True:
            if self.chunk == len(self.chunks):
                size = max(self.CHUNK, nbytes)
                if self.reserved_bytes + size > self.limit:
                    raise GraphCaptureUnsupported(
                        f"a recording needs more than the {self.limit >> 20} MiB of CPU graph memory "
                        "(PORTASERVE_CPU_GRAPH_MEMORY_MB)")
                self.chunks.append(torch.empty(size, dtype=torch.uint8))
            chunk = self.chunks[self.chunk]
            if self.offset + nbytes <= chunk.numel():
                view = chunk[self.offset : self.offset + nbytes]
                self.offset += nbytes
                return view
            self.chunk, self.offset = self.chunk + 1, 0


_EMPTY = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)


class _WatchOps(TorchDispatchMode):
    """Refuses aten ops that compute; gives new tensors arena memory; keeps every tensor
    produced while recording alive."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch would wrap __torch_dispatch__ in dynamo.disable, importing torch._dynamo
        # (1.5 s) at the first capture: an inter-token stall in a running server. Nothing
        # is compiled while recording.
        return False

    def __init__(self, arena: Arena) -> None:
        super().__init__()
        self.arena = arena
        self.keep: dict[int, torch.Tensor] = {}  # by id: identity ops return a tensor again

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _EMPTY and kwargs.get("device") in (None, torch.device("cpu")):
            out = self._from_arena(func, args, kwargs)
            if out is not None:
                self.keep[id(out)] = out
                return out
        out = func(*args, **kwargs)
        # `.to()` / `.contiguous()` of a tensor already so return it: nothing computed
        identity = bool(args) and out is args[0]
        if func.overloadpacket not in NO_COMPUTE and not identity:
            raise GraphCaptureUnsupported(f"the step runs {func}, which a CPU graph cannot replay")
        if not identity:  # a tensor made before recording, returned as it is
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.keep[id(t)] = t
        return out

    def _from_arena(self, func, args, kwargs) -> torch.Tensor | None:
        """A new contiguous tensor of the requested shape and dtype in the arena (None: a
        layout this does not handle, allocated as usual)."""
        shape = [int(d) for d in args[0]]
        if func is torch.ops.aten.empty_strided.default and [int(s) for s in args[1]] != _contiguous_strides(shape):
            return None
        if kwargs.get("layout") not in (None, torch.strided) or kwargs.get("pin_memory"):
            return None
        if kwargs.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
            return None
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        return self.arena.take(nbytes)[:nbytes].view(dtype).view(shape)


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return strides[::-1]


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
            # graph_replay.c: (index + 1) * 1000 + the kernel's small (maybe negative) code
            index = (rc + 500) // 1000 - 1 if rc > 0 else -rc - 1
            name = self.names.get(self.kinds[index], "?") if 0 <= index < self.num_ops else "?"
            raise RuntimeError(f"CPU graph replay failed at call {index} ({name}): code {rc}")


class CpuGraphs(GraphCapture):
    """Records the C kernel calls of a decode step (see the module docstring)."""

    #: Every size up to 32, unpadded: a padded row costs ~0.7 ms of matmuls per step for
    #: SmolLM2 here, a good part of what a recording saves. Past 32 decodes the step is
    #: matmul-bound, and the Python around it matters little.
    batch_sizes = tuple(range(1, 33))

    def __init__(self, kernels: native.NativeKernels | None, memory_bytes: int | None = None) -> None:
        self.kernels = kernels
        if memory_bytes is None:
            memory_bytes = int(os.environ.get("PORTASERVE_CPU_GRAPH_MEMORY_MB", "256")) << 20
        self.arena = Arena(memory_bytes)
        self.verified = False  # a replay reproduced its eager step once

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[CpuGraph, torch.Tensor]:
        if self.kernels is None:
            raise GraphCaptureUnsupported(f"the CPU's C kernels are not available ({native.unavailable_reason()})")
        calls: list[tuple[int, list[int]]] = []
        originals = {}
        for name in native.entry_points():
            originals[name] = getattr(self.kernels, name)
            setattr(self.kernels, name, self._recording(name, originals[name], calls))
        self.arena.rewind()
        watch = _WatchOps(self.arena)
        try:
            with watch:
                out = fn()
        finally:
            for name, fn_ in originals.items():
                setattr(self.kernels, name, fn_)
        if not isinstance(out, torch.Tensor):
            raise GraphCaptureUnsupported(f"the step returned {type(out).__name__}, not one tensor")
        # The arena owns the bytes of the tensors made while recording, so their Python
        # objects may go; one still held elsewhere after that (a workspace created or grown
        # lazily, a cache) would share arena bytes with the next recording's intermediates.
        # The caller's eager run should have made those already.
        made = [weakref.ref(t) for t in watch.keep.values() if t is not out and self.arena.holds(t)]
        keep = [t for t in watch.keep.values() if not self.arena.holds(t)]  # their own memory: kept
        watch.keep.clear()
        escaped = [t for t in (r() for r in made) if t is not None]
        if escaped:
            shapes = ", ".join(str(tuple(t.shape)) for t in escaped[:3])
            raise GraphCaptureUnsupported(f"tensors made while recording outlive the step ({shapes}): a lazily made "
                                          "workspace or cache; run the step eagerly once first")
        graph = CpuGraph(self.kernels, calls, [*keep, out, self.arena])
        if not self.verified:
            # once per model: every batch size runs the same code, which the checks above
            # already watched; a step costs a few ms to tens of ms, paid per recording
            expected = out.clone()
            graph.replay()
            if not torch.equal(out, expected):
                raise GraphCaptureUnsupported("replaying the recorded kernels did not reproduce the eager step")
            self.verified = True
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
