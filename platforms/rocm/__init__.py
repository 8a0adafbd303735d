"""The rocm platform: AMD GPUs through a HIP build of torch, rccl, device-memory KV cache.

torch's HIP build exposes AMD GPUs through the ``torch.cuda`` API and ``"cuda"`` device
strings, and rccl through the ``nccl`` backend name; this package keeps them apart from
NVIDIA by checking ``torch.version.hip``.
"""

from portaserve.framework.hookspecs import hookimpl

PORTASERVE_CONTRACT = "1.3"


@hookimpl
def portaserve_platform():
    from .platform import RocmPlatform

    return RocmPlatform


@hookimpl
def portaserve_communicators():
    return {"rccl": "portaserve.platforms.rocm.communicator:RcclCommunicator"}


@hookimpl
def portaserve_kv_cache_allocators():
    return {"rocm": "portaserve.platforms.rocm.kv_cache:RocmKVCacheAllocator"}


@hookimpl
def portaserve_attention_backends():
    return {"triton": "portaserve.kernels.triton_backend:TritonAttentionBackend"}


@hookimpl
def portaserve_custom_ops():
    from portaserve.kernels.ops import triton_ops  # imports no triton

    return triton_ops(frozenset({"rocm"}))
