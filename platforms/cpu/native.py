"""The CPU platform's C kernels: compiled at first use with the machine's C compiler.

`paged_decode.c` is plain C with AVX-512 paths where the compiler targets them
(`-march=native`), built into a shared library under portaserve's cache folder
(keyed by the source, the compiler, the flags and the CPU, so a second start loads it at
once) and called through ctypes. Like tinygrad's CPU device or torch.compile's C++
backend, it needs a C compiler at run time (`$CC`, else `cc`, `gcc` or `clang`); where
there is none, or it fails, or `PORTASERVE_CPU_NATIVE=0`, `load()` returns None with the
reason logged once, and the attention backend keeps its torch path.

The library is linked with `-fopenmp`. torch has already loaded its own `libgomp.so.1`
by then, so the dynamic linker binds ours to it: the kernel's threads are torch's threads
and `torch.set_num_threads` governs both.
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
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("portaserve")

SOURCE = Path(__file__).with_name("paged_decode.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-std=gnu11")
LIBS = ("-lm",)

_lock = threading.Lock()
_loaded: "NativeKernels | None" = None
_reason: str | None = None
_tried = False

_P = ctypes.c_void_p
_I32 = ctypes.c_int
_I64 = ctypes.c_int64
_F32 = ctypes.c_float


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library's entry points (see paged_decode.c for their contracts)."""

    path: Path
    paged_decode: ctypes._CFuncPtr
    workspace_floats: ctypes._CFuncPtr
    scratch_floats: ctypes._CFuncPtr


def _compiler() -> str | None:
    cc = os.environ.get("CC", "").strip()
    if cc:
        return shutil.which(cc) or (cc if os.path.isfile(cc) else None)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


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


def library_path(cc: str) -> Path:
    from portaserve.framework.checkpoint import portaserve_cache_dir

    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), cc, _compiler_version(cc), " ".join(FLAGS + LIBS), _cpu_key()]).encode()
    ).hexdigest()[:20]
    return portaserve_cache_dir() / "native" / f"cpu_kernels-{key}.so"


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: ranks of a tensor-parallel run may build at once.
    fd, tmp = tempfile.mkstemp(prefix=target.stem + "-", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, str(SOURCE), "-o", tmp, *LIBS]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(path: Path) -> NativeKernels:
    lib = ctypes.CDLL(str(path))
    fn = lib.ps_paged_decode
    fn.restype = _I32
    fn.argtypes = [_P, _I64, _P, _P, _I64, _P, _P, _P, _P, _P, _P,
                   _I32, _I32, _I32, _I32, _I32, _I32, _F32, _F32, _I32, _P, _P, _I32]
    ws = lib.ps_workspace_floats
    ws.restype = _I64
    ws.argtypes = [_I32, _I32, _I32]
    sc = lib.ps_scratch_floats
    sc.restype = _I64
    sc.argtypes = [_I64, _I32, _I32, _I32]
    return NativeKernels(path, fn, ws, sc)


def load() -> NativeKernels | None:
    """The kernels, built on first use; None (reason in `unavailable_reason()`) when they cannot be."""
    global _loaded, _reason, _tried
    with _lock:
        if _tried:
            return _loaded
        _tried = True
        if os.environ.get("PORTASERVE_CPU_NATIVE", "1") == "0":
            _reason = "PORTASERVE_CPU_NATIVE=0"
            return None
        cc = _compiler()
        if cc is None:
            _reason = "no C compiler found ($CC, cc, gcc, clang): install gcc for the faster CPU decode attention"
        else:
            try:
                path = library_path(cc)
                if not path.exists():
                    start = time.perf_counter()
                    _build(cc, path)
                    logger.info("portaserve: built the CPU kernels with %s in %.1f s: %s", cc, time.perf_counter() - start, path)
                _loaded = _bind(path)
            except Exception as exc:  # noqa: BLE001 - any failure means: use the torch path
                _reason = f"building the CPU kernels failed: {type(exc).__name__}: {exc}"
        if _loaded is None:
            logger.warning("portaserve: CPU decode attention runs on the torch path (slower): %s", _reason)
        return _loaded


def unavailable_reason() -> str | None:
    """Why `load()` returned None (None when it has not run or succeeded)."""
    return _reason


def reset_for_tests() -> None:
    """Forget the loaded library (tests switch PORTASERVE_CPU_NATIVE on and off)."""
    global _loaded, _reason, _tried
    with _lock:
        _loaded, _reason, _tried = None, None, False
