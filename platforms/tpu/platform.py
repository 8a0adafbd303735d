"""TpuPlatform: Google TPUs through torch_xla's PJRT runtime.

The probe, in order (each step only if the previous one passed):
1. ``importlib.util.find_spec("torch_xla")``: installed? (nothing is imported);
2. ``PJRT_DEVICE``, when set, must name TPU (it pins PJRT to another device otherwise);
3. the PCI bus (``/sys/bus/pci/devices``): TPU chips attached, and their generation
   from the PCI device id, read from sysfs without any library;
4. PJRT itself, asked from a short-lived child process that imports torch_xla and
   reports the device type, device count and HBM size as JSON. A child, because in the
   probing process the import would write ``PJRT_DEVICE`` into ``os.environ`` and opening
   the PJRT client would hold the TPU chips, which only one process may own, so the
   workers started later could not.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from portaserve.framework.interfaces import SCORE_ACCELERATOR, DeviceInfo, Platform, PlatformCapabilities, Unavailable

#: Where PCI devices are listed (a module attribute so tests can point it at a fake tree).
PCI_DEVICES = "/sys/bus/pci/devices"
GOOGLE_PCI_VENDOR = "0x1ae0"
#: PCI device id -> TPU generation.
TPU_PCI_DEVICES = {"0x0027": "v3", "0x005e": "v4", "0x0062": "v5p", "0x0063": "v5e", "0x006f": "v6e"}
#: HBM per chip, used when PJRT does not report memory.
HBM_BYTES = {"v3": 32 * 2**30, "v4": 32 * 2**30, "v5p": 95 * 2**30, "v5e": 16 * 2**30, "v6e": 32 * 2**30}
#: Generations whose MXUs multiply int8.
_INT8_GENERATIONS = frozenset({"v4", "v5p", "v5e", "v6e"})
PJRT_QUERY_TIMEOUT_S = 120.0
_MARKER = "PORTASERVE_PJRT "

# Runs in the child: import torch_xla, open PJRT, report; the exit frees the chips.
_PJRT_QUERY = f"""
import json
import torch_xla
import torch_xla.runtime as xr
import torch_xla.core.xla_model as xm
out = {{"device_type": xr.device_type()}}
if out["device_type"] == "TPU":
    dev = torch_xla.device() if hasattr(torch_xla, "device") else xm.xla_device()
    out["hw"] = xm.xla_device_hw(dev)
    out["num_devices"] = int(xr.addressable_runtime_device_count())
    try:
        out["memory"] = {{k: int(v) for k, v in xm.get_memory_info(dev).items()}}
    except Exception as exc:
        out["memory_error"] = repr(exc)
print({_MARKER!r} + json.dumps(out))
"""


def tpu_chips(root: str | None = None) -> list[str]:
    """Generations of the TPU chips attached through PCI ("v5e", ...), one entry per chip."""
    chips = []
    base = Path(root or PCI_DEVICES)
    if not base.is_dir():
        return chips
    for dev in sorted(base.iterdir()):
        try:
            vendor = (dev / "vendor").read_text().strip().lower()
            device = (dev / "device").read_text().strip().lower()
        except OSError:
            continue
        if vendor == GOOGLE_PCI_VENDOR and device in TPU_PCI_DEVICES:
            chips.append(TPU_PCI_DEVICES[device])
    return chips


def query_pjrt(spec) -> dict:
    """Ask PJRT about the TPU from a child process; raises RuntimeError with the child's error."""
    env = dict(os.environ)  # the child's copy: this process's environment is not touched
    env.setdefault("PJRT_DEVICE", "TPU")
    # The child must import the torch_xla this process found (it may come from sys.path
    # entries that PYTHONPATH does not list).
    origin = spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin
    root = str(Path(origin).parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    timeout = float(os.environ.get("PORTASERVE_TPU_PROBE_TIMEOUT", PJRT_QUERY_TIMEOUT_S))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PJRT_QUERY], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"PJRT did not answer within {timeout:.0f} s (PORTASERVE_TPU_PROBE_TIMEOUT)") from None
    for line in proc.stdout.splitlines():
        if line.startswith(_MARKER):
            return json.loads(line[len(_MARKER) :])
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise RuntimeError(f"torch_xla exited with status {proc.returncode}: {tail}")


def _hbm_bytes(answer: dict, generation: str) -> int:
    mem = answer.get("memory") or {}
    if "bytes_limit" in mem:
        return int(mem["bytes_limit"])
    if "kb_total" in mem:
        return int(mem["kb_total"]) * 1024
    return HBM_BYTES.get(generation, 16 * 2**30)


class TpuPlatform(Platform):
    name = "tpu"
    device_type = "xla"
    dist_backend = "xla"
    ray_resource = "TPU"

    @classmethod
    def probe(cls) -> DeviceInfo | Unavailable:
        """torch_xla installed, TPU chips on the PCI bus, and PJRT opens them (asked from a child process)."""
        spec = importlib.util.find_spec("torch_xla")
        if spec is None:
            return Unavailable(cls.name, "torch_xla is not installed (pip install 'portaserve[tpu]' on a TPU VM)")
        pjrt = os.environ.get("PJRT_DEVICE", "").strip()
        if pjrt and not pjrt.upper().startswith("TPU"):
            return Unavailable(cls.name, f"PJRT_DEVICE={pjrt} selects a PJRT device other than TPU")
        chips = tpu_chips()
        if not chips:
            return Unavailable(
                cls.name,
                f"torch_xla is installed but no TPU chip is attached (no PCI device of vendor {GOOGLE_PCI_VENDOR} under {PCI_DEVICES})",
            )
        try:
            answer = query_pjrt(spec)
        except (RuntimeError, OSError, ValueError) as exc:
            return Unavailable(cls.name, f"{len(chips)} TPU chip(s) found, but PJRT could not open them: {exc}")
        if answer.get("device_type") != "TPU":
            return Unavailable(cls.name, f"PJRT selected device type {answer.get('device_type')!r}, not TPU")
        generation = chips[0]
        num_devices = int(answer.get("num_devices") or len(chips))
        extra = {"chips": str(len(chips)), "pjrt_device_type": "TPU"}
        if len(set(chips)) > 1:
            extra["note"] = f"mixed TPU generations {sorted(set(chips))}"
        return DeviceInfo(
            platform=cls.name,
            device_name=f"TPU {generation}",
            device_count=num_devices,
            total_memory_bytes=_hbm_bytes(answer, generation),
            score=SCORE_ACCELERATOR,
            reason=f"{len(chips)} TPU {generation} chip(s) on the PCI bus, opened through torch_xla's PJRT runtime",
            capability=generation,
            extra=extra,
        )

    def capabilities(self) -> PlatformCapabilities:
        features = {"xla"}
        if self.info.capability in _INT8_GENERATIONS:
            features.add("int8_matmul")
        return PlatformCapabilities(
            # fp16 is emulated on TPUs; bf16 is what the MXUs multiply natively.
            dtypes=frozenset({torch.float32, torch.bfloat16}),
            kv_cache_dtypes=frozenset({"auto"}),
            features=frozenset(features),
            compile_backends={"default": "openxla"},
            default_compilation_mode="none",
            block_sizes=frozenset({16, 32, 64, 128}),
            default_block_size=16,
        )

    def preferred_attention_backends(self) -> tuple[str, ...]:
        return ("xla_paged",)

    def default_communicator(self) -> str:
        return "xla"

    def default_kv_cache_allocator(self) -> str:
        return "tpu"

    def _torch_device(self, local_rank: int) -> torch.device:
        # Each rank's process owns its chip(s) through PJRT; its default device is the one to use.
        import torch_xla

        return torch_xla.device()

    def _memory_info(self, local_rank: int) -> tuple[int, int]:
        import torch_xla.core.xla_model as xm

        mem = xm.get_memory_info(self._torch_device(local_rank))
        if "bytes_limit" in mem:
            total = int(mem["bytes_limit"])
            return total - int(mem.get("bytes_used", 0)), total
        return int(mem["kb_free"]) * 1024, int(mem["kb_total"]) * 1024

    def synchronize(self, local_rank: int = 0) -> None:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()
