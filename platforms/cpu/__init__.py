"""The CPU platform: always available, lowest score, gloo, host-memory KV cache."""

from portaserve.framework.hookspecs import hookimpl

PORTASERVE_CONTRACT = "1.0"


@hookimpl
def portaserve_platform():
    from .platform import CpuPlatform

    return CpuPlatform


@hookimpl
def portaserve_attention_backends():
    return {"cpu_paged": "portaserve.platforms.cpu.attention:CpuPagedAttentionBackend"}


@hookimpl
def portaserve_communicators():
    return {"gloo": "portaserve.platforms.cpu.communicator:GlooCommunicator"}


@hookimpl
def portaserve_kv_cache_allocators():
    return {"cpu": "portaserve.platforms.cpu.kv_cache:HostKVCacheAllocator"}
