"""The tpu platform: Google TPUs through torch_xla and PJRT, XLA collectives, KV cache in HBM.

torch_xla is imported only inside functions: importing it selects a PJRT device
(writing ``PJRT_DEVICE`` into the environment), so the probe asks PJRT from a
short-lived child process instead, see platform.py.
"""

from portaserve.framework.hookspecs import hookimpl

PORTASERVE_CONTRACT = "1.1"


@hookimpl
def portaserve_platform():
    from .platform import TpuPlatform

    return TpuPlatform


@hookimpl
def portaserve_communicators():
    return {"xla": "portaserve.platforms.tpu.communicator:XlaCommunicator"}


@hookimpl
def portaserve_kv_cache_allocators():
    return {"tpu": "portaserve.platforms.tpu.kv_cache:XlaKVCacheAllocator"}


@hookimpl
def portaserve_attention_backends():
    return {"xla_paged": "portaserve.kernels.xla_attention:XlaPagedAttentionBackend"}
