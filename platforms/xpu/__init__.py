"""The xpu platform: Intel GPUs through torch.xpu, xccl (or oneCCL's ccl), device-memory KV cache.

intel-extension-for-pytorch is optional: when installed it is used (imported by the
components that need it, never at import time of this package).
"""

from portaserve.framework.hookspecs import hookimpl

PORTASERVE_CONTRACT = "1.1"


@hookimpl
def portaserve_platform():
    from .platform import XpuPlatform

    return XpuPlatform


@hookimpl
def portaserve_communicators():
    return {"xccl": "portaserve.platforms.xpu.communicator:XcclCommunicator"}


@hookimpl
def portaserve_kv_cache_allocators():
    return {"xpu": "portaserve.platforms.xpu.kv_cache:XpuKVCacheAllocator"}


@hookimpl
def portaserve_attention_backends():
    return {"triton": "portaserve.kernels.triton_backend:TritonAttentionBackend"}


@hookimpl
def portaserve_custom_ops():
    from portaserve.kernels.ops import triton_ops  # imports no triton

    return triton_ops(frozenset({"xpu"}))
