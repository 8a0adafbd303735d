"""Static-shape buckets for XLA devices (TPU): pure Python, no torch.

XLA compiles one graph per distinct set of input shapes, so a step whose batch shape
changes every time would recompile every time. Each variable dimension of a step is
therefore padded up to one of a few bucket sizes: powers of two (at most 2x waste), and
past `linear_step` multiples of it (bounded absolute waste for large token counts).
The number of graphs is then at most the product of the buckets' lengths, and
`StepBuckets.num_graphs` says how many the engine may compile (what to warm up).

Dimensions: tokens of the step (the model runner pads its inputs to `tokens`), sequences,
the longest new-token run of a sequence (`query_lens`, 1 for a decode-only step), and
KV blocks per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Buckets:
    """Ascending bucket sizes; `pad(n)` is the smallest size >= n."""

    name: str
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ValueError(f"{self.name} buckets: at least one size is required")
        if self.sizes[0] < 1 or any(b <= a for a, b in zip(self.sizes, self.sizes[1:])):
            raise ValueError(f"{self.name} buckets must be positive and strictly ascending, got {self.sizes}")

    @property
    def maximum(self) -> int:
        return self.sizes[-1]

    def pad(self, n: int) -> int:
        """The bucket for `n` (0 pads to the smallest bucket); ValueError past the largest."""
        if n < 0:
            raise ValueError(f"{self.name}: a count must be >= 0, got {n}")
        lo, hi = 0, len(self.sizes)
        while lo < hi:  # first size >= n
            mid = (lo + hi) // 2
            if self.sizes[mid] < n:
                lo = mid + 1
            else:
                hi = mid
        if lo == len(self.sizes):
            raise ValueError(f"{self.name}: {n} exceeds the largest bucket {self.maximum}; allowed: 0..{self.maximum}")
        return self.sizes[lo]

    @classmethod
    def geometric(cls, name: str, minimum: int, maximum: int, *, linear_step: int | None = None) -> "Buckets":
        """`minimum, 2*minimum, 4*minimum, ...` up to `maximum` (always the last bucket);
        past `linear_step`, multiples of `linear_step` instead of doublings."""
        if minimum < 1 or maximum < minimum:
            raise ValueError(f"{name} buckets: need 1 <= minimum <= maximum, got {minimum}, {maximum}")
        if linear_step is not None and linear_step < 1:
            raise ValueError(f"{name} buckets: linear_step must be >= 1, got {linear_step}")
        sizes = []
        size = minimum
        while size < maximum:
            sizes.append(size)
            if linear_step is not None and size >= linear_step:
                size = (size // linear_step + 1) * linear_step
            else:
                size *= 2
        sizes.append(maximum)
        return cls(name, tuple(sizes))


@dataclass(frozen=True, slots=True)
class StepShape:
    """The padded shape of one step."""

    num_tokens: int
    num_seqs: int
    max_query_len: int
    blocks_per_seq: int


@dataclass(frozen=True, slots=True)
class StepBuckets:
    """The buckets of every dimension of a step."""

    tokens: Buckets
    seqs: Buckets
    query_lens: Buckets
    blocks: Buckets

    @classmethod
    def for_limits(
        cls,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        min_tokens: int = 16,
        min_seqs: int = 8,
        linear_step: int = 512,
    ) -> "StepBuckets":
        """Buckets covering every step an engine with these limits can schedule."""
        for param, value in (
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("block_size", block_size),
        ):
            if value < 1:
                raise ValueError(f"{param} must be >= 1, got {value}")
        max_query = min(max_num_batched_tokens, max_model_len)
        max_blocks = -(-max_model_len // block_size)
        return cls(
            tokens=Buckets.geometric("tokens", min(min_tokens, max_num_batched_tokens), max_num_batched_tokens, linear_step=linear_step),
            seqs=Buckets.geometric("seqs", min(min_seqs, max_num_seqs), max_num_seqs),
            query_lens=Buckets.geometric("query_lens", 1, max_query, linear_step=linear_step),
            blocks=Buckets.geometric("blocks", 1, max_blocks, linear_step=linear_step),
        )

    def step_shape(self, num_tokens: int, num_seqs: int, max_query_len: int, blocks_per_seq: int) -> StepShape:
        """Pad one step's counts to their buckets."""
        if max_query_len > num_tokens:
            raise ValueError(f"max_query_len {max_query_len} exceeds num_tokens {num_tokens}")
        return StepShape(
            num_tokens=self.tokens.pad(num_tokens),
            num_seqs=self.seqs.pad(num_seqs),
            max_query_len=self.query_lens.pad(max_query_len),
            blocks_per_seq=self.blocks.pad(blocks_per_seq),
        )

    def num_graphs(self) -> int:
        """Upper bound on the distinct step shapes, hence on XLA compilations."""
        return len(self.tokens.sizes) * len(self.seqs.sizes) * len(self.query_lens.sizes) * len(self.blocks.sizes)


def pad_list(values: Sequence[int], length: int, fill: int) -> list[int]:
    """`values` followed by `fill` up to `length` (ValueError when already longer)."""
    if len(values) > length:
        raise ValueError(f"{len(values)} values do not fit a padded length of {length}")
    return list(values) + [fill] * (length - len(values))
