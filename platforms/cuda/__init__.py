"""The cuda platform: NVIDIA GPUs through a CUDA build of torch, nccl, device-memory KV cache.

Nothing here imports torch.cuda state at import time; the classes are imported when the
loader calls the hooks, and the probe touches the CUDA runtime only inside `probe()`.
The Triton attention backend and fused ops (portaserve.kernels) are registered here,
imported only when the plan binds them.
"""

from portaserve.framework.hookspecs import hookimpl

PORTASERVE_CONTRACT = "1.3"


@hookimpl
def portaserve_platform():
    from .platform import CudaPlatform

    return CudaPlatform


@hookimpl
def portaserve_communicators():
    return {"nccl": "portaserve.platforms.cuda.communicator:NcclCommunicator"}


@hookimpl
def portaserve_kv_cache_allocators():
    return {"cuda": "portaserve.platforms.cuda.kv_cache:CudaKVCacheAllocator"}


@hookimpl
def portaserve_attention_backends():
    return {"triton": "portaserve.kernels.triton_backend:TritonAttentionBackend"}


@hookimpl
def portaserve_custom_ops():
    from portaserve.kernels.ops import triton_ops  # imports no triton

    return triton_ops(frozenset({"cuda"}))
