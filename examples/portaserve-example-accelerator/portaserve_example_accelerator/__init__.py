"""portaserve-example-accelerator: the hooks of the imaginary "nova" accelerator.

portaserve imports this module because pyproject.toml names it in the
``portaserve.platforms`` entry-point group. It stays cheap to import: every class is
named by a ``"module:Class"`` string, imported when first used.

What the plugin brings, each through a documented hook (contract 1.1):

- the platform ``nova`` (``portaserve_platform``): computes on the host CPU, serves only
  KV blocks of 32 tokens and says so (`PlatformCapabilities.block_sizes` /
  `default_block_size`), so ``LLM(model, device="nova")`` needs no ``--block-size``;
- the attention backend ``nova_paged`` with a vLLM-style KV layout ``[2, num_blocks,
  block_size, num_kv_heads, head_size]`` (``kv_cache_block_dim = 1``), its KV-cache
  allocator and its gloo communicator;
- a new op, ``split_qkv_rope`` (``portaserve_op_specs``): the fused q/k/v split and
  rotary embedding, with its torch reference, and nova's implementation of it and of
  the built-in ``silu_and_mul`` (``portaserve_custom_ops``);
- nova's own ``LlamaForCausalLM`` (``portaserve_platform_model_architectures``), used
  for Llama checkpoints on nova only, every other platform keeping the generic one;
- the quantization method ``nova_int8`` (``portaserve_quant_methods``): int8 weights
  with per-channel scales, for nova only.

From portaserve it imports only ``portaserve.framework.hookspecs``,
``portaserve.framework.interfaces`` and ``portaserve.framework.errors``
(``ci/check_example_imports.py`` checks it).
"""

from portaserve.framework.hookspecs import hookimpl

PORTASERVE_CONTRACT = "1.1"

_PKG = "portaserve_example_accelerator"


@hookimpl
def portaserve_platform():
    from .platform import NovaPlatform

    return NovaPlatform


@hookimpl
def portaserve_attention_backends():
    return {"nova_paged": f"{_PKG}.attention:NovaPagedAttentionBackend"}


@hookimpl
def portaserve_kv_cache_allocators():
    return {"nova": f"{_PKG}.kv_cache:NovaKVCacheAllocator"}


@hookimpl
def portaserve_communicators():
    return {"nova_gloo": f"{_PKG}.communicator:NovaGlooCommunicator"}


@hookimpl
def portaserve_quant_methods():
    return {"nova_int8": f"{_PKG}.quant:NovaInt8Method"}


@hookimpl
def portaserve_op_specs():
    from .ops import OP_SPECS

    return OP_SPECS


@hookimpl
def portaserve_custom_ops():
    from .ops import OP_IMPLS

    return OP_IMPLS


@hookimpl
def portaserve_platform_model_architectures():
    return {"nova": {"LlamaForCausalLM": f"{_PKG}.llama:NovaLlamaForCausalLM"}}
