"""NovaPlatform: an imaginary accelerator that computes on the host CPU through torch.

What makes it an "accelerator" to portaserve is only what it declares: KV blocks of 32
tokens and nothing else, its own attention backend / allocator / communicator, the
feature ``nova_int8`` its quantization method requires. Its score is below the cpu
platform's, so ``--device auto`` keeps choosing cpu on a machine that has both, and
``--device nova`` (or ``PORTASERVE_DEVICE=nova``) selects it.
"""

from __future__ import annotations

import os

import torch

from portaserve.framework.interfaces import DeviceInfo, Platform, PlatformCapabilities

#: Below cpu's 0 and the example platform's -10.
SCORE_NOVA = -20
#: The only KV block size nova's attention serves (its "hardware" tile is 32 tokens).
NOVA_BLOCK_SIZE = 32
#: KV-cache budget when --kv-cache-memory is not given.
DEFAULT_KV_CACHE_BYTES = 256 * 2**20


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory, from sysconf."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    try:
        available = page * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        available = total // 2
    return available, total


class NovaPlatform(Platform):
    name = "nova"
    device_type = "cpu"
    dist_backend = "gloo"
    # The "device" is the host: tensor-parallel ranks share it.
    ranks_share_device = True

    @classmethod
    def probe(cls) -> DeviceInfo:
        """Always available (the device is simulated on the host). Reads sysconf only."""
        _available, total = host_memory()
        return DeviceInfo(
            platform=cls.name,
            device_name="nova accelerator (simulated on the host CPU)",
            device_count=1,
            total_memory_bytes=total,
            score=SCORE_NOVA,
            reason="the nova example plugin simulates its accelerator on the host CPU and is always available; "
            "its score is below cpu's, so select it with --device nova",
            capability="nova-1",
        )

    def capabilities(self) -> PlatformCapabilities:
        return PlatformCapabilities(
            dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
            kv_cache_dtypes=frozenset({"auto"}),
            # nova_int8 needs this (a real plugin would set it from the probed chip)
            features=frozenset({"nova_int8"}),
            compile_backends={},
            default_compilation_mode="none",
            block_sizes=frozenset({NOVA_BLOCK_SIZE}),
            default_block_size=NOVA_BLOCK_SIZE,
            preferred_dtypes=(torch.bfloat16, torch.float32),
        )

    def preferred_attention_backends(self) -> tuple[str, ...]:
        return ("nova_paged",)

    def default_communicator(self) -> str:
        return "nova_gloo"

    def default_kv_cache_allocator(self) -> str:
        return "nova"

    def _torch_device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def _memory_info(self, local_rank: int) -> tuple[int, int]:
        return host_memory()

    def _default_kv_cache_bytes(self, local_rank: int) -> int:
        available, _total = host_memory()
        return int(min(DEFAULT_KV_CACHE_BYTES, available // 4))
