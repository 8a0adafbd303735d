"""CpuPlatform: the host CPU through torch's CPU kernels (oneDNN, AMX for bf16 where present)."""

from __future__ import annotations

import os
import platform as _pyplatform

import torch

from portaserve.framework.interfaces import SCORE_CPU, DeviceInfo, Platform, PlatformCapabilities
from portaserve.platforms.cpu.host_allocator import keep_freed_memory
from portaserve.platforms.cpu import native

#: `compile_backends` name of the CPU's decode graphs (graphs.py; kept here so that the
#: platform's capabilities import nothing heavy)
CPU_GRAPHS = "cpu_graphs"

# vLLM's CPU backend defaults to 4 GiB of KV cache; we also stay under a quarter of free RAM.
DEFAULT_KV_CACHE_GIB = 4.0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _pyplatform.processor() or _pyplatform.machine() or "CPU"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _meminfo() -> tuple[int, int]:
    """(available, total) bytes of host memory."""
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
        return fields.get("MemAvailable", fields["MemFree"]), fields["MemTotal"]
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total // 2, total


def _num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    ranks_share_device = True  # tensor-parallel ranks share the one host

    @classmethod
    def probe(cls) -> DeviceInfo:
        flags = _cpu_flags()
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
        _avail, total = _meminfo()
        return DeviceInfo(
            platform=cls.name,
            device_name=_cpu_name(),
            device_count=1,
            total_memory_bytes=total,
            score=SCORE_CPU,
            reason=f"the host CPU is always available ({_num_cores()} cores)",
            capability=",".join(isa) or None,
            extra={"cores": str(_num_cores())},
        )

    def capabilities(self) -> PlatformCapabilities:
        c_kernels = native.enabled()
        return PlatformCapabilities(
            dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
            kv_cache_dtypes=frozenset({"auto"}),
            features=frozenset(
                {"int8_matmul"}
                # torch's `_weight_int8pack_mm` (the "int8" method's fast CPU kernel)
                | ({"int8_weight_pack_mm"} if hasattr(torch.ops.aten, "_weight_int8pack_mm") else set())
                # the sampler's host fast paths: block-wise argmax / topk beat torch's here,
                # and scratch buffers are kept (no caching allocator in front of mmap)
                | {"sampler_block_reductions", "sampler_reuse_buffers"}
                | ({"triton"} if os.environ.get("TRITON_INTERPRET") == "1" else set())
                # the C kernels (decode attention, fused ops) build here: native.py
                | ({"c_kernels"} if c_kernels else set())
            ),
            # "default": decode steps of up to 8 sequences replayed from recorded C kernel
            # calls (graphs.py), where the C kernels build; it halves a SmolLM2 token's time
            # (BENCHMARKS.md). "max": torch.compile with inductor.
            compile_backends={"default": CPU_GRAPHS if c_kernels else "inductor", "max": "inductor"},
            default_compilation_mode="default" if c_kernels else "none",
            graph_backends=frozenset({CPU_GRAPHS}),
            # A prompt token costs ~2-3 ms of matmul here (a Qwen2-0.5B-shaped model on 2
            # cores), so a step mixing 30 decodes with a whole 2048-token prompt chunk stalls
            # every stream for seconds. `bench serve` at 32 streams (BENCHMARKS.md): ITL p99
            # 0.37-0.45 s at 96, ~0.48-0.65 s at 128, 0.4-3.6 s uncapped (vLLM ~0.6 s), with
            # TTFT p99 still below vLLM's. The offline API keeps no cap.
            serving_prefill_cap=96,
            block_sizes=frozenset({8, 16, 32, 64, 128}),
            default_block_size=16,
            preferred_dtypes=(torch.bfloat16, torch.float32, torch.float16),
        )

    def preferred_attention_backends(self) -> tuple[str, ...]:
        return ("cpu_paged",)

    def default_communicator(self) -> str:
        return "gloo"

    def default_kv_cache_allocator(self) -> str:
        return "cpu"

    def _torch_device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def _memory_info(self, local_rank: int) -> tuple[int, int]:
        return _meminfo()

    def _default_kv_cache_bytes(self, local_rank: int) -> int:
        available, _total = _meminfo()
        return int(min(DEFAULT_KV_CACHE_GIB * 2**30, available * 0.25))

    def graph_capture(self, compile_backend: str, local_rank: int = 0):
        if compile_backend != CPU_GRAPHS:
            return None
        from portaserve.platforms.cpu.graphs import cpu_graphs

        return cpu_graphs()

    def _init_worker(self, local_rank: int) -> None:
        keep_freed_memory()
        threads = os.environ.get("PORTASERVE_CPU_THREADS")
        if threads:
            torch.set_num_threads(int(threads))
