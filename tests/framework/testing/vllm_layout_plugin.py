"""A platform plugin whose attention backend keeps vLLM's KV layout, for the kit's tests.

The "vlayout" device computes on the host CPU. Its backend stores the KV cache as
``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K and V planes first, block
ids on dim 1: ``kv_cache_block_dim = 1``), in plain torch, one sequence at a time. The
platform serves block sizes 16 and 32 (default 32). It also declares an op of its own
(``vlayout_gelu_and_mul``), implements it and ``rms_norm``, and contributes a quant
method (a "none" variant keeping the weight transposed). tests/framework/testing/test_kit_layouts.py
and test_kit_components.py run the kit's checks on its parts in process;
test_conformance.py installs it as a distribution and runs the whole kit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from portaserve.framework.distributed import TorchDistributedCommunicator
from portaserve.framework.hookspecs import hookimpl
from portaserve.framework.interfaces import (
    AttentionBackend,
    AttentionBatch,
    AttentionMetadata,
    DeviceInfo,
    KVCacheAllocator,
    Platform,
    PlatformCapabilities,
    QuantMethod,
)
from portaserve.framework.interfaces.ops import OpImpl, OpSpec

PORTASERVE_CONTRACT = "1.1"
NAME = "vlayout"


def _host_memory() -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    return total // 2, total


@dataclass(frozen=True, slots=True)
class VllmLayoutMetadata(AttentionMetadata):
    query_start_loc: list[int]
    seq_lens: list[int]
    # block_table: [num_seqs, max_blocks] int64; slot_mapping: [num_actual_tokens] int64
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class VllmLayoutAttentionBackend(AttentionBackend):
    """Paged attention over a ``[2, num_blocks, block_size, kv_heads, head_size]`` cache."""

    name = "vlayout_torch"
    metadata_type = VllmLayoutMetadata
    platforms = frozenset({NAME})
    supported_dtypes = frozenset({torch.float32, torch.bfloat16, torch.float16})
    supported_block_sizes = frozenset({16, 32})
    supports_sliding_window = True
    supports_encoder = True
    kv_cache_block_dim = 1

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_size)

    def build_metadata(self, batch: AttentionBatch) -> VllmLayoutMetadata:
        n = batch.num_actual_tokens
        return VllmLayoutMetadata(
            num_actual_tokens=n,
            query_start_loc=batch.query_start_loc.tolist(),
            seq_lens=batch.seq_lens.tolist(),
            block_table=batch.block_table.to(self.device, torch.int64),
            slot_mapping=self.slots_to_write(batch).to(self.device),
        )

    def slots_to_write(self, batch: AttentionBatch) -> torch.Tensor:
        """Slots of the real tokens only: padding past num_actual_tokens is never written."""
        return batch.slot_mapping[: batch.num_actual_tokens].to(torch.int64)

    def write(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        # kv_cache[0] / [1]: [num_blocks, block_size, kv_heads, head] -> one row per slot
        kv_cache[0].flatten(0, 1).index_copy_(0, slots, k.to(kv_cache.dtype))
        kv_cache[1].flatten(0, 1).index_copy_(0, slots, v.to(kv_cache.dtype))

    def _forward(self, q, k, v, kv_cache, metadata: VllmLayoutMetadata) -> torch.Tensor:
        out = torch.zeros_like(q)
        if kv_cache is not None:
            m = metadata.slot_mapping.shape[0]
            self.write(kv_cache, k[:m], v[:m], metadata.slot_mapping)
        bounds = metadata.query_start_loc
        for i, seq_len in enumerate(metadata.seq_lens):
            a, b = bounds[i], bounds[i + 1]
            if kv_cache is None:  # encoder: attends to its own tokens, no cache
                keys, values = k[a:b], v[a:b]
            else:
                blocks = metadata.block_table[i, : -(-seq_len // self.block_size)]
                # [2, blocks, block_size, kv_heads, head] -> [seq_len, kv_heads, head]
                keys = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:seq_len]
                values = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:seq_len]
            out[a:b] = self._attend(q[a:b], keys, values).to(q.dtype)
        return out

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        qlen, kv_len = q.shape[0], keys.shape[0]
        ratio = spec.num_heads // spec.num_kv_heads
        qf = q.float().transpose(0, 1)  # [heads, qlen, d]
        kf = keys.float().repeat_interleave(ratio, dim=1).transpose(0, 1)  # [heads, kv_len, d]
        vf = values.float().repeat_interleave(ratio, dim=1).transpose(0, 1)
        scores = qf @ kf.transpose(1, 2) * spec.scale
        if spec.logits_soft_cap is not None:
            scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
        if spec.causal:
            pos = torch.arange(kv_len - qlen, kv_len).unsqueeze(1)  # each query's position
            kv_pos = torch.arange(kv_len).unsqueeze(0)
            allowed = kv_pos <= pos
            if spec.sliding_window is not None:
                allowed &= kv_pos > pos - spec.sliding_window
            scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        return (torch.softmax(scores, dim=-1) @ vf).transpose(0, 1)


class VllmLayoutKVCacheAllocator(KVCacheAllocator):
    name = NAME
    platforms = frozenset({NAME})

    def _allocate(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
        return [torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in zip(shapes, dtypes, strict=True)]


class VllmLayoutCommunicator(TorchDistributedCommunicator):
    name = "vlayout_gloo"
    platforms = frozenset({NAME})
    dist_backend = "gloo"


# ----- an op of its own, and implementations -------------------------------------------


def gelu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] -> gelu_tanh(x[..., :d]) * x[..., d:]."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def gelu_and_mul_samples(device, dtype, gen):
    return [(torch.randn(tokens, 2 * d, generator=gen).to(device=device, dtype=dtype),) for tokens, d in ((1, 64), (9, 256))]


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The tanh formula spelled out, in float32."""
    gate, up = x.float().chunk(2, dim=-1)
    gelu = 0.5 * gate * (1 + torch.tanh(0.7978845608028654 * (gate + 0.044715 * gate**3)))
    return (gelu * up).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf / torch.sqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


GELU_AND_MUL = OpSpec("vlayout_gelu_and_mul", "vlayout_gelu_and_mul(x: [..., 2d]) -> gelu_tanh(x[..., :d]) * x[..., d:]",
                      gelu_and_mul_reference, gelu_and_mul_samples)


# ----- a quant method of its own -------------------------------------------------------


class TransposedLinearMethod(QuantMethod):
    """The "none" numerics with the weight kept as [in, out] after loading."""

    name = "vlayout_linear"
    platforms = frozenset({NAME})
    variant_of = "none"
    variant_priority = 5

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, params_dtype: torch.dtype, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False) if bias else None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight_t = layer.weight.data.t().contiguous()  # [in, out]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = x @ layer.weight_t
        return y if bias is None else y + bias


class VllmLayoutPlatform(Platform):
    name = NAME
    device_type = "cpu"
    dist_backend = "gloo"
    # VLAYOUT_ONE_DEVICE_PER_RANK=1 makes it a one-device accelerator whose ranks each need
    # a device (the kit's world-size-2 check then cannot run here).
    ranks_share_device = os.environ.get("VLAYOUT_ONE_DEVICE_PER_RANK") != "1"

    @classmethod
    def probe(cls) -> DeviceInfo:
        return DeviceInfo(platform=NAME, device_name="host CPU (vLLM-style KV layout)", device_count=1,
                          total_memory_bytes=_host_memory()[1], score=-20,
                          reason="a test device on the host CPU; select it with --device vlayout")

    def capabilities(self) -> PlatformCapabilities:
        return PlatformCapabilities(
            dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
            kv_cache_dtypes=frozenset({"auto"}),
            block_sizes=frozenset({16, 32}),
            default_block_size=32,
        )

    def preferred_attention_backends(self) -> tuple[str, ...]:
        return (VllmLayoutAttentionBackend.name,)

    def default_communicator(self) -> str:
        return VllmLayoutCommunicator.name

    def _torch_device(self, local_rank: int) -> torch.device:
        return torch.device("cpu")

    def _memory_info(self, local_rank: int) -> tuple[int, int]:
        return _host_memory()

    def _default_kv_cache_bytes(self, local_rank: int) -> int:
        return 2**28


@hookimpl
def portaserve_platform():
    return VllmLayoutPlatform


@hookimpl
def portaserve_attention_backends():
    return {VllmLayoutAttentionBackend.name: VllmLayoutAttentionBackend}


@hookimpl
def portaserve_kv_cache_allocators():
    return {VllmLayoutKVCacheAllocator.name: VllmLayoutKVCacheAllocator}


@hookimpl
def portaserve_communicators():
    return {VllmLayoutCommunicator.name: VllmLayoutCommunicator}


@hookimpl
def portaserve_op_specs():
    return [GELU_AND_MUL]


@hookimpl
def portaserve_custom_ops():
    here = frozenset({NAME})
    return [OpImpl(op=GELU_AND_MUL.name, name="vlayout_torch", platforms=here, fn=gelu_and_mul),
            OpImpl(op="rms_norm", name="vlayout_torch", platforms=here, fn=rms_norm)]


@hookimpl
def portaserve_quant_methods():
    return {TransposedLinearMethod.name: TransposedLinearMethod}
