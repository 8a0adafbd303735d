"""The CPU platform: always available, lowest score, gloo, host-memory KV cache."""

from portaserve.framework.hookspecs import hookimpl

PORTASERVE_CONTRACT = "1.3"


@hookimpl
def portaserve_platform():
    from .platform import CpuPlatform

    return CpuPlatform


@hookimpl
def portaserve_attention_backends():
    # Triton runs on the CPU only under TRITON_INTERPRET=1 (for tests); the platform
    # declares the "triton" feature only then, and never prefers it.
    return {
        "cpu_paged": "portaserve.platforms.cpu.attention:CpuPagedAttentionBackend",
        "triton": "portaserve.kernels.triton_backend:TritonAttentionBackend",
    }


@hookimpl
def portaserve_communicators():
    return {"gloo": "portaserve.platforms.cpu.communicator:GlooCommunicator"}


@hookimpl
def portaserve_kv_cache_allocators():
    return {"cpu": "portaserve.platforms.cpu.kv_cache:HostKVCacheAllocator"}


@hookimpl
def portaserve_quant_methods():
    # the plan picks them in place of "none" and "gguf" (see QuantMethod.variant_of)
    return {
        "onednn": "portaserve.platforms.cpu.onednn_linear:OneDnnLinearMethod",
        "gguf_cpu": "portaserve.platforms.cpu.gguf_linear:CpuGGUFMethod",
    }


@hookimpl
def portaserve_custom_ops():
    # Fused RMSNorm / SiLU-and-mul / rotary in C (fused_ops.c); the platform declares
    # "c_kernels" when a C compiler is there to build them (native.py).
    from portaserve.framework.interfaces.ops import OpImpl

    ops = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "apply_token_bitmask", "lora_linear")
    return [
        OpImpl(op=op, name="cpu_c", platforms=frozenset({"cpu"}), fn=f"portaserve.platforms.cpu.fused_ops:{op}",
               required_features=frozenset({"c_kernels"}), traceable=False)
        for op in ops
    ]
