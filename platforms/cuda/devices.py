"""Reading GPU properties through torch.cuda, shared by the cuda and rocm probes.

What a probe touches (documented because probes must be side-effect free):
- ``torch.cuda.is_available()``: ``cudaGetDeviceCount`` (hipGetDeviceCount on ROCm),
  which initializes the driver (cuInit) but creates no device context; with
  ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` it asks NVML instead;
- ``torch.cuda.device_count()``: NVML / amdsmi when present, else the runtime count;
- ``torch.cuda.get_device_properties(i)``: torch's lazy CUDA init plus
  ``cudaGetDeviceProperties``; it reads static properties, creates no context on the
  device and allocates no memory.
``torch.cuda.mem_get_info`` is not called: it creates a context (hundreds of MiB on the
device), so free memory is asked for only after the platform is chosen. Like any use of
the CUDA runtime, probing means worker processes must be started with spawn, not fork
(portaserve's executors spawn).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuProps:
    """The static properties of one visible GPU."""

    index: int
    name: str
    total_memory_bytes: int
    major: int
    minor: int
    #: "gfx942:sramecc+:xnack-" on ROCm builds, "" on CUDA builds.
    gcn_arch_name: str
    num_multiprocessors: int


def visible_gpus() -> list[GpuProps]:
    """Properties of every GPU torch.cuda can see (empty if none); no device context is created."""
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(
            GpuProps(
                index=i,
                name=str(props.name),
                total_memory_bytes=int(props.total_memory),
                major=int(props.major),
                minor=int(props.minor),
                gcn_arch_name=str(getattr(props, "gcnArchName", "") or ""),
                num_multiprocessors=int(getattr(props, "multi_processor_count", 0) or 0),
            )
        )
    return gpus


def summarize(gpus: list[GpuProps]) -> tuple[str, str | None]:
    """(device name, note) for a list of GPUs; the note says when they are not all alike."""
    names = sorted({g.name for g in gpus})
    if len(names) == 1:
        return names[0], None
    return names[0], f"mixed GPU models ({', '.join(names)}): capabilities are those of the least capable"
