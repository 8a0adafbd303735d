"""The `AttentionBackend` interface: attention over a paged KV cache.

The model runner describes each step once, as an `AttentionBatch` of host tensors; the
backend turns it into its own metadata (`build_metadata`, once per step, shared by every
layer) and then runs `forward` once per layer: the public `forward` checks the inputs
and calls the `_forward` an implementation defines. A backend instance serves one layer
type (`AttentionSpec`): a model with sliding-window and full layers has two.

Token order in every tensor: the tokens of sequence 0, then sequence 1, ...; each
sequence contributes `query_len` new tokens (a prefill chunk, or 1 for a decode) that
attend to its `seq_len` tokens of context, the new ones included.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """What one layer type asks of its attention backend."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"  # "auto" (= dtype) or "fp8"
    sliding_window: int | None = None  # attend to at most this many most recent tokens
    causal: bool = True  # False for encoders, which also keep no KV cache
    logits_soft_cap: float | None = None

    @property
    def uses_kv_cache(self) -> bool:
        return self.causal

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True, slots=True)
class AttentionBatch:
    """One step's attention work as host tensors, built once by the model runner."""

    # query_start_loc: [num_seqs + 1] int32, offsets of each sequence's new tokens
    query_start_loc: torch.Tensor
    # seq_lens: [num_seqs] int32, context length after this step (computed + new tokens)
    seq_lens: torch.Tensor
    # block_table: [num_seqs, max_blocks_per_seq] int32, padded with 0 past seq_lens
    block_table: torch.Tensor
    # slot_mapping: [num_tokens] int64, flat cache slot (block * block_size + offset) per new token
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Tokens past this index are padding (static-shape platforms); the rest are real.
    num_actual_tokens: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Base class of the per-step metadata a backend builds; backends subclass it."""

    num_actual_tokens: int


class AttentionBackend(ABC):
    """Paged attention for one layer type, with declared capabilities.

    Class attributes declare what the backend supports; `unsupported_reason` checks a
    spec against them (the plan calls it before any weights load).
    """

    name: ClassVar[str]
    #: Platform names this backend runs on; None: any platform that declares its
    #: `required_features` (a portable kernel, e.g. one written in Triton).
    platforms: ClassVar[frozenset[str] | None]
    supported_dtypes: ClassVar[frozenset[torch.dtype]]
    supported_kv_cache_dtypes: ClassVar[frozenset[str]] = frozenset({"auto"})
    #: None means any head size.
    supported_head_sizes: ClassVar[frozenset[int] | None] = None
    supported_block_sizes: ClassVar[frozenset[int]]
    supports_sliding_window: ClassVar[bool] = False
    supports_encoder: ClassVar[bool] = False
    #: Largest num_heads / num_kv_heads the backend handles; None means any.
    max_gqa_ratio: ClassVar[int | None] = None
    #: Platform features the backend needs (e.g. "triton"); see PlatformCapabilities.
    required_features: ClassVar[frozenset[str]] = frozenset()
    #: The dimension of the `kv_cache_shape` tensor that block ids index: 0 for a
    #: block-major layout `[num_blocks, ...]`, 1 for vLLM's `[2, num_blocks, block_size,
    #: kv_heads, head_size]` (K and V planes first). The backend owns the layout: the
    #: engine allocates exactly `kv_cache_shape` and tells the allocator this dimension
    #: when it moves blocks (offload, sleep); the conformance kit checks any layout
    #: through it.
    kv_cache_block_dim: ClassVar[int] = 0
    #: The metadata class `build_metadata` returns; `forward` rejects any other (contract 1.1).
    metadata_type: ClassVar[type[AttentionMetadata]] = AttentionMetadata

    def __init__(self, spec: AttentionSpec, block_size: int, device: torch.device) -> None:
        cls = type(self)
        if cls._forward is AttentionBackend._forward and cls.forward is AttentionBackend.forward:
            raise TypeError(f"{cls.__name__} defines no _forward (nor, as contract 1.0 backends do, forward)")
        reason = self.unsupported_reason(spec, block_size)
        if reason is not None:
            raise ValueError(f"{self.name} attention backend: {reason}")
        self.spec = spec
        self.block_size = block_size
        self.device = device

    @classmethod
    def runs_on(cls, platform: str) -> bool:
        """Whether the backend is declared for `platform` (its features are checked apart)."""
        return cls.platforms is None or platform in cls.platforms

    @classmethod
    def unsupported_reason(cls, spec: AttentionSpec, block_size: int) -> str | None:
        """Why this backend cannot serve `spec` with `block_size`, or None if it can."""
        if spec.dtype not in cls.supported_dtypes:
            return f"dtype {spec.dtype} not in {_names(cls.supported_dtypes)}"
        if spec.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            return f"kv_cache_dtype {spec.kv_cache_dtype!r} not in {sorted(cls.supported_kv_cache_dtypes)}"
        if cls.supported_head_sizes is not None and spec.head_size not in cls.supported_head_sizes:
            return f"head size {spec.head_size} not in {sorted(cls.supported_head_sizes)}"
        if spec.uses_kv_cache and block_size not in cls.supported_block_sizes:
            return f"block size {block_size} not in {sorted(cls.supported_block_sizes)}"
        if spec.sliding_window is not None and not cls.supports_sliding_window:
            return "sliding-window attention is not supported"
        if not spec.causal and not cls.supports_encoder:
            return "encoder (non-causal) attention is not supported"
        if spec.num_heads % spec.num_kv_heads:
            return f"num_heads {spec.num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}"
        if cls.max_gqa_ratio is not None and spec.gqa_ratio > cls.max_gqa_ratio:
            return f"GQA ratio {spec.gqa_ratio} exceeds {cls.max_gqa_ratio}"
        return cls._unsupported_reason(spec, block_size)

    @classmethod
    def _unsupported_reason(cls, spec: AttentionSpec, block_size: int) -> str | None:
        """Extra checks an implementation adds; None means supported."""
        return None

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of this layer's KV-cache tensor (K and V together) for `num_blocks` blocks;
        dimension `kv_cache_block_dim` has size `num_blocks`, and the tensor's bytes are
        proportional to it."""

    def kv_cache_torch_dtype(self) -> torch.dtype:
        """Element type of the KV-cache tensor."""
        if self.spec.kv_cache_dtype == "fp8":
            return torch.float8_e4m3fn
        return self.spec.dtype

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one block of this layer's KV cache takes."""
        numel = 1
        for dim in self.kv_cache_shape(1):
            numel *= dim
        return numel * torch.empty((), dtype=self.kv_cache_torch_dtype()).element_size()

    @abstractmethod
    def build_metadata(self, batch: AttentionBatch) -> AttentionMetadata:
        """Turn the step's host description into device-side metadata (once per step)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write the new K/V into their cache slots, then attend: checks the inputs against
        the spec, then calls `_forward`. The checks read shapes, dtypes and types only (no
        device sync), a few microseconds per layer.

        A contract 1.0 backend overrides `forward` itself (before 1.1 it was the abstract
        method) and keeps working: this wrapper then never runs.

        :param q: [num_tokens, num_heads, head_size]
        :param k: [num_tokens, num_kv_heads, head_size] (new tokens only)
        :param v: [num_tokens, num_kv_heads, head_size]
        :param kv_cache: this layer's cache tensor of `kv_cache_shape`, or None for encoders.
        :param metadata: what `build_metadata` built for this step (a `metadata_type`).
        :returns: [num_tokens, num_heads, head_size]; rows past num_actual_tokens are unspecified.
        :raises ValueError: shapes or dtypes unlike the spec's, or no cache for a causal layer.
        :raises TypeError: metadata that is not a `metadata_type`.
        """
        spec = self.spec
        qs, ks = q.shape, k.shape
        if (
            len(qs) != 3
            or qs[1] != spec.num_heads
            or qs[2] != spec.head_size
            or ks != v.shape
            or len(ks) != 3
            or ks[0] != qs[0]
            or ks[1] != spec.num_kv_heads
            or ks[2] != spec.head_size
        ):
            raise ValueError(
                f"{self.name} attention backend: q {list(qs)}, k {list(ks)}, v {list(v.shape)}; expected "
                f"q [num_tokens, {spec.num_heads}, {spec.head_size}], k and v [num_tokens, {spec.num_kv_heads}, "
                f"{spec.head_size}]"
            )
        if not q.dtype == k.dtype == v.dtype == spec.dtype:
            raise ValueError(f"{self.name} attention backend: q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype}, expected {spec.dtype}")
        if kv_cache is None and spec.uses_kv_cache:
            raise ValueError(f"{self.name} attention backend: a KV cache is required (None only for encoder layers)")
        if not isinstance(metadata, self.metadata_type):
            raise TypeError(f"{self.name} attention backend got {type(metadata).__name__}, not {self.metadata_type.__name__}")
        return self._forward(q, k, v, kv_cache, metadata)

    def _forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The attention itself, with inputs `forward` checked (shapes and dtypes as the
        spec says, a cache for causal layers, a `metadata_type`); what a backend defines.
        Writes the real tokens' K/V (`metadata.num_actual_tokens`) into their slots first."""
        raise NotImplementedError(f"{type(self).__name__} defines no _forward")


def _names(dtypes) -> list[str]:
    return sorted(str(d).removeprefix("torch.") for d in dtypes)
