"""The CPU platform's C kernels: compiled at first use with the machine's C compiler.

`paged_decode.c` (decode attention), `fused_ops.c` (RMSNorm, SiLU-and-mul, rotary) and
`gguf_matmul.c` / `gguf_gemm.c` (matmuls with GGUF-quantized weights: int8 dot products
for a few rows, a bf16 small-batch GEMM for more), `lora.c` (LoRA adapters for a few
tokens) and `graph_replay.c` (the KV-cache
write, and decode graphs: recorded kernel calls replayed in one call, see graphs.py) are plain C with AVX-512 paths where the compiler targets them (`-march=native`), built
into one shared library under portaserve's cache folder (keyed by the sources, the
compiler, the flags and the CPU, so a second start loads it at once) and called through
ctypes. Like tinygrad's CPU device or torch.compile's C++ backend, this needs a C
compiler at run time (`$CC`, else `cc`, `gcc` or `clang`); where there is none, or it
fails, or `PORTASERVE_CPU_NATIVE=0`, `load()` returns None with the reason logged once,
and the layers and the attention backend keep their torch code.

The library is linked with `-fopenmp`. torch has already loaded its own `libgomp.so.1`
by then, so the dynamic linker binds ours to it: the kernels' threads are torch's
threads, and `torch.set_num_threads` governs both.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

logger = logging.getLogger("portaserve")

HERE = Path(__file__).parent
SOURCES = (HERE / "paged_decode.c", HERE / "fused_ops.c", HERE / "gguf_matmul.c", HERE / "gguf_gemm.c",
           HERE / "graph_replay.c", HERE / "lora.c")
HEADERS = (HERE / "cpu_simd.h", HERE / "cpu_kernels.h", HERE / "gguf_codes.h")
FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-std=gnu11")
LIBS = ("-lm",)

_lock = threading.Lock()
_loaded: "NativeKernels | None" = None
_reason: str | None = None
_tried = False

_P = ctypes.c_void_p
_I32 = ctypes.c_int
_I64 = ctypes.c_int64
_F32 = ctypes.c_float

# name -> (restype, argtypes) of every entry point (see the C files for their contracts)
_SIGNATURES = {
    "ps_paged_decode": (_I32, [_P, _I64, _P, _P, _I64, _P, _P, _P, _P, _P, _P,
                               _I32, _I32, _I32, _I32, _I32, _I32, _F32, _F32, _I32, _P, _P, _I32]),
    "ps_workspace_floats": (_I64, [_I32, _I32, _I32]),
    "ps_scratch_floats": (_I64, [_I64, _I32, _I32, _I32]),
    "ps_fused_workspace_floats": (_I64, [_I32]),
    "ps_rms_norm": (_I32, [_P, _I64, _P, _P, _P, _P, _I64, _I32, _F32, _I32, _P, _I32]),
    "ps_silu_and_mul": (_I32, [_P, _I64, _P, _I64, _I32, _I32, _I32]),
    "ps_apply_token_bitmask": (_I32, [_P, _I64, _P, _I64, _I64, _I64, _I32]),
    "ps_lora_linear": (_I32, [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I32, _P, _I32]),
    "ps_gguf_vnni": (_I32, []),
    "ps_gguf_matmul": (_I32, [_P, _I64, _I32, _I64, _I64, _P, _I32, _I32, _P, _P, _I64, _P, _P, _I64, _I32, _I32]),
    "ps_gguf_gemm_available": (_I32, []),
    "ps_gguf_gemm": (_I32, [_P, _I64, _I32, _I64, _I64, _P, _I32, _I32, _P, _P, _I64, _P, _P, _I64, _I32, _I32]),
    "ps_gguf_dequantize": (_I32, [_P, _I32, _I32, _P, _P, _I64, _I64, _P, _I32, _I32]),
    "ps_gguf_embedding": (_I32, [_P, _I64, _P, _I32, _I32, _P, _P, _I64, _I64, _P, _I32]),
    "ps_kv_write": (_I32, [_P, _P, _P, _P, _I64, _I64, _P, _I64, _I64, _I64, _I32, _I32, _I32]),
    "ps_graph_replay": (_I64, [_P, _I64]),
    "ps_rotary": (_I32, [_P, _P, _I64, _I64, _P, _I64, _I64, _P, _P, _P, _I64,
                         _I32, _I32, _I32, _I32, _I32, _I32, _P, _I32]),
}


def entry_points() -> tuple[str, ...]:
    """Every entry point's attribute name on `NativeKernels` (without the `ps_` prefix)."""
    return tuple(name.removeprefix("ps_") for name in _SIGNATURES)


class NativeKernels:
    """The loaded library: its path and its entry points as attributes named without the
    `ps_` prefix (`kernels.paged_decode(...)`, `kernels.rms_norm(...)`)."""

    def __init__(self, path: Path, march: str, lib: ctypes.CDLL) -> None:
        self.path, self.march, self.lib = path, march, lib
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name.removeprefix("ps_"), fn)


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc, gcc or clang on PATH."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        return shutil.which(cc) or (cc if os.path.isfile(cc) else None)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def enabled() -> bool:
    """Whether the kernels may be used (a compiler is there and PORTASERVE_CPU_NATIVE is not 0).

    Cheap: the plan asks it to bind the fused ops; the build itself happens in the worker.
    """
    return os.environ.get("PORTASERVE_CPU_NATIVE", "1") != "0" and compiler() is not None


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    lines = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in wanted]
    return platform.machine() + "\n" + "\n".join(sorted(set(lines)))


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _flags(march: str) -> list[str]:
    return [*FLAGS, f"-march={march}", f"-I{HERE}"]


def library_path(cc: str, march: str = "native") -> Path:
    from portaserve.framework.checkpoint import portaserve_cache_dir

    parts = [p.read_text() for p in SOURCES + HEADERS]
    parts += [cc, _compiler_version(cc), " ".join(_flags(march) + list(LIBS)), _cpu_key()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    return portaserve_cache_dir() / "native" / f"cpu_kernels-{march}-{key}.so"


def _build(cc: str, march: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: ranks of a tensor-parallel run may build at once.
    fd, tmp = tempfile.mkstemp(prefix=target.stem + "-", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cc, *_flags(march), *map(str, SOURCES), "-o", tmp, *LIBS]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build(march: str = "native") -> NativeKernels:
    """Build (or find in the cache) and load the kernels for `-march=march`; raises on failure.

    `load()` is the engine's entry; tests also build a portable variant (`x86-64-v3`) to
    check the code paths CPUs without AVX-512 take.
    """
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc, clang): install gcc for the faster CPU kernels")
    path = library_path(cc, march)
    if not path.exists():
        start = time.perf_counter()
        try:
            _build(cc, march, path)
        except PermissionError:  # a read-only cache folder: build in the temporary folder
            path = Path(tempfile.gettempdir()) / f"portaserve-native-{os.getuid()}" / path.name
            if not path.exists():
                _build(cc, march, path)
        logger.info("portaserve: built the CPU kernels with %s in %.1f s: %s", cc, time.perf_counter() - start, path)
    return NativeKernels(path, march, ctypes.CDLL(str(path)))


def load() -> NativeKernels | None:
    """The kernels for this CPU, built on first use; None (reason in `unavailable_reason()`)
    when they cannot be."""
    global _loaded, _reason, _tried
    if _tried:  # every layer asks, every step: no lock once decided
        return _loaded
    with _lock:
        if _tried:
            return _loaded
        _tried = True
        if os.environ.get("PORTASERVE_CPU_NATIVE", "1") == "0":
            _reason = "PORTASERVE_CPU_NATIVE=0"
            return None
        try:
            _loaded = build()
        except Exception as exc:  # noqa: BLE001 - any failure means: use the torch code
            _reason = f"building the CPU kernels failed: {type(exc).__name__}: {exc}"
            logger.warning("portaserve: the CPU runs its torch code instead of the C kernels (slower): %s", _reason)
        return _loaded


def unavailable_reason() -> str | None:
    """Why `load()` returned None (None when it has not run or succeeded)."""
    return _reason
