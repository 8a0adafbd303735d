"""ExamplePlatform: an "example" device that computes on the host CPU through torch."""

from __future__ import annotations

import os

import torch

from portaserve.framework.interfaces import DeviceInfo, Platform, PlatformCapabilities

#: Below the cpu platform's 0: `--device auto` keeps choosing cpu, `--device example` selects this.
SCORE_EXAMPLE = -10
#: KV-cache budget when --kv-cache-memory is not given.
DEFAULT_KV_CACHE_BYTES = 1 * 2**30


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory, from sysconf (no /proc parsing needed)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    try:
        available = page * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        available = total // 2
    return available, total


class ExamplePlatform(Platform):
    name = "example"
    device_type = "cpu"
    dist_backend = "gloo"
    # Like the cpu platform, several tensor-parallel ranks share the one host: `--tensor-
    # parallel-size 2` needs no second device, and the kit runs its 2-process collectives here.
    ranks_share_device = True

    @classmethod
    def probe(cls) -> DeviceInfo:
        """Always available: the example device is the host CPU. Reads sysconf only."""
        _available, total = host_memory()
        return DeviceInfo(
            platform=cls.name,
            device_name="example device (host CPU)",
            device_count=1,
            total_memory_bytes=total,
            score=SCORE_EXAMPLE,
            reason="the example plugin's device computes on the host CPU and is always available; "
            "its score is below cpu's, so select it with --device example",
            extra={"threads": str(torch.get_num_threads())},
        )

    def capabilities(self) -> PlatformCapabilities:
        return PlatformCapabilities(
            dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
            kv_cache_dtypes=frozenset({"auto"}),
            features=frozenset(),
            compile_backends={"default": "inductor"},
            default_compilation_mode="none",
            # what example_paged serves; the engine's usual 16 is the default
            block_sizes=frozenset({8, 16, 32, 64, 128}),
            default_block_size=16,
            preferred_dtypes=(torch.bfloat16, torch.float32, torch.float16),
        )

    def preferred_attention_backends(self) -> tuple[str, ...]:
        return ("example_paged",)

    def default_communicator(self) -> str:
        return "example_gloo"

    def default_kv_cache_allocator(self) -> str:
        return "example"

    def _torch_device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def _memory_info(self, local_rank: int) -> tuple[int, int]:
        return host_memory()

    def _default_kv_cache_bytes(self, local_rank: int) -> int:
        available, _total = host_memory()
        return int(min(DEFAULT_KV_CACHE_BYTES, available // 4))
