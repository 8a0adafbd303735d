"""Linear layers, tensor-parallel by construction.

Every layer asks `ctx.quant_method(prefix)` to create its parameters and to multiply,
so a quantized checkpoint changes the method, not the model. Each rank creates only its
shard and each parameter carries a `weight_loader(param, loaded, shard_id=None)` that
cuts this rank's slice out of the full checkpoint tensor, so no rank ever holds the
whole model.

Sharding follows Megatron: a column-parallel layer splits its outputs (no communication;
the next row-parallel layer consumes the split activations), a row-parallel layer splits
its inputs and all-reduces its partial sums through `ctx.communicator`.

Which dims of a parameter shard: a QuantMethod may tag a parameter with `output_dim` /
`input_dim` (vLLM's convention); untagged parameters default to the unquantized layout,
`weight: [out, in]` and 1-D `[out]` tensors such as the bias. Scalars (per-tensor scales)
are replicated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from portaserve.framework.layer_context import LayerContext

from .lora import attach as attach_lora


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size {denominator}")
    return numerator // denominator


def _shard_dims(param: torch.Tensor, output_size: int) -> tuple[int | None, int | None]:
    """(output_dim, input_dim) of `param`: its tags, else the unquantized layout."""
    if hasattr(param, "output_dim") or hasattr(param, "input_dim"):
        return getattr(param, "output_dim", None), getattr(param, "input_dim", None)
    if param.dim() == 2:
        return 0, 1
    if param.dim() == 1 and param.shape[0] == output_size:
        return 0, None
    return None, None


def _copy_into(target: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
    target.copy_(loaded)


class LinearBase(nn.Module):
    """Shared plumbing: the quant method, the per-rank sizes, the weight loaders."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        input_size_per_rank: int,
        output_size_per_rank: int,
        bias: bool,
        ctx: LayerContext,
        prefix: str,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_rank = input_size_per_rank
        self.output_size_per_rank = output_size_per_rank
        self.tp_rank = ctx.tp_rank
        self.tp_size = ctx.tp_size
        self.communicator = ctx.communicator
        self.prefix = prefix
        self.quant_method = ctx.quant_method(prefix)
        self.quant_method.create_weights(self, input_size_per_rank, output_size_per_rank, ctx.dtype, bias)
        if not hasattr(self, "bias"):
            self.bias = None
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader
        # LoRA slots when the engine serves adapters (models/layers/lora.py)
        self.lora = attach_lora(self, ctx.lora)

    def lora_slices(self) -> list[tuple[int, int, int, int]]:
        """Per output part: (first row of this rank's share, rows, offset in this rank's
        output, the part's full size): how a LoRA B is cut like this layer's weight."""
        return [(0, self.output_size_per_rank, 0, self.output_size)]

    def lora_input_slice(self) -> tuple[int, int] | None:
        """(first column, columns) of the input this rank sees, when the input is split."""
        return None

    def _with_lora(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return y if self.lora is None else self.lora.add(y, x)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's part of the full checkpoint tensor `loaded` into `param`."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size_per_rank}/{self.input_size}, out={self.output_size_per_rank}/{self.output_size}, "
            f"bias={self.bias is not None}, quant={self.quant_method.name}"
        )


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole layer (small projections not worth splitting)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, ctx: LayerContext, prefix: str) -> None:
        super().__init__(input_size, output_size, input_size, output_size, bias, ctx, prefix)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        _copy_into(param.data, loaded, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._with_lora(self.quant_method.apply(self, x, self.bias), x)


class ColumnParallelLinear(LinearBase):
    """`y = x W^T + b` with W's output rows split across ranks: rank r computes the r-th
    slice of y. `gather_output` all-gathers the slices (rarely needed: the next layer is
    usually row-parallel and wants them split)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        ctx: LayerContext,
        prefix: str,
        gather_output: bool = False,
        output_sizes: Sequence[int] | None = None,
    ) -> None:
        # output_sizes: the fused sub-layers (gate, up) or (q, k, v); each is split on its own
        self.output_sizes = list(output_sizes) if output_sizes is not None else [output_size]
        per_rank = self._per_rank_sizes(ctx.tp_size)
        super().__init__(input_size, output_size, input_size, sum(per_rank), bias, ctx, prefix)
        self.gather_output = gather_output

    def _per_rank_sizes(self, tp_size: int) -> list[int]:
        return [divide(size, tp_size, f"output size of {type(self).__name__}") for size in self.output_sizes]

    def lora_slices(self) -> list[tuple[int, int, int, int]]:
        per_rank = self._per_rank_sizes(self.tp_size)
        return [(self.tp_rank * size, size, sum(per_rank[:j]), full)
                for j, (size, full) in enumerate(zip(per_rank, self.output_sizes))]

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        output_dim, _ = _shard_dims(param, self.output_size_per_rank)
        if output_dim is None or loaded.dim() == 0:
            _copy_into(param.data, loaded, self.prefix)
            return
        size = param.shape[output_dim]
        shard = loaded.narrow(output_dim, self.tp_rank * size, size)
        _copy_into(param.data, shard, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, input_size] -> y: [num_tokens, output_size_per_rank]
        y = self._with_lora(self.quant_method.apply(self, x, self.bias), x)
        if self.gather_output and self.tp_size > 1:
            y = self.communicator.all_gather(y, dim=-1)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers with one input fused into one matmul (gate and up of
    a gated MLP). The checkpoint's separate tensors load with `shard_id` = their index."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool, ctx: LayerContext, prefix: str) -> None:
        super().__init__(input_size, sum(output_sizes), bias, ctx, prefix, output_sizes=output_sizes)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        output_dim, _ = _shard_dims(param, self.output_size_per_rank)
        if shard_id is None or output_dim is None or loaded.dim() == 0:
            if shard_id is None and output_dim is not None and loaded.dim() > 0:
                # a checkpoint that stores the fused tensor: split it into its parts
                offset = 0
                for i, size in enumerate(self.output_sizes):
                    part = size * loaded.shape[output_dim] // self.output_size
                    self.weight_loader(param, loaded.narrow(output_dim, offset, part), i)
                    offset += part
                return
            _copy_into(param.data, loaded, self.prefix)
            return
        per_rank = self._per_rank_sizes(self.tp_size)
        # Sizes scale with the parameter's output dim (a packed quantized weight is smaller).
        scale_num, scale_den = param.shape[output_dim], self.output_size_per_rank
        start = sum(per_rank[:shard_id]) * scale_num // scale_den
        size = per_rank[shard_id] * scale_num // scale_den
        target = param.data.narrow(output_dim, start, size)
        shard = loaded.narrow(output_dim, self.tp_rank * size, size)
        _copy_into(target, shard, f"{self.prefix} (part {shard_id})")


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection of attention, split by heads across ranks.

    Query heads split evenly; KV heads split too, or, when there are fewer KV heads than
    ranks, each KV head is replicated on `tp_size // num_kv_heads` ranks. Output layout
    on each rank: [q (num_heads_per_rank * head_size), k, v (num_kv_heads_per_rank * head_size each)].
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        ctx: LayerContext,
        prefix: str,
    ) -> None:
        tp = ctx.tp_size
        self.head_size = head_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_heads_per_rank = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads_per_rank = divide(num_kv_heads, tp, "num_key_value_heads")
            self.num_kv_replicas = 1
        else:
            self.num_kv_heads_per_rank = 1
            self.num_kv_replicas = divide(tp, num_kv_heads, "tensor_parallel_size over num_key_value_heads")
        self.q_size = self.num_heads_per_rank * head_size
        self.kv_size = self.num_kv_heads_per_rank * head_size
        super().__init__(
            hidden_size,
            (num_heads + 2 * num_kv_heads) * head_size,
            bias,
            ctx,
            prefix,
            output_sizes=[self.q_size * tp, self.kv_size * tp, self.kv_size * tp],
        )

    def _per_rank_sizes(self, tp_size: int) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def lora_slices(self) -> list[tuple[int, int, int, int]]:
        q, kv = self.q_size, self.kv_size
        kv_rank = self.tp_rank // self.num_kv_replicas
        return [(self.tp_rank * q, q, 0, self.num_heads * self.head_size),
                (kv_rank * kv, kv, q, self.num_kv_heads * self.head_size),
                (kv_rank * kv, kv, q + kv, self.num_kv_heads * self.head_size)]

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        output_dim, _ = _shard_dims(param, self.output_size_per_rank)
        if output_dim is None or loaded.dim() == 0:
            _copy_into(param.data, loaded, self.prefix)
            return
        if shard_id is None:
            # a checkpoint that stores q, k and v fused: split by the global head counts
            total = self.output_size
            sizes = [self.num_heads * self.head_size, self.num_kv_heads * self.head_size, self.num_kv_heads * self.head_size]
            offset = 0
            for sid, size in zip("qkv", sizes):
                part = size * loaded.shape[output_dim] // total
                self.weight_loader(param, loaded.narrow(output_dim, offset, part), sid)
                offset += part
            return
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"{self.prefix}: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        scale_num, scale_den = param.shape[output_dim], self.output_size_per_rank
        q, kv = self.q_size * scale_num // scale_den, self.kv_size * scale_num // scale_den
        if shard_id == "q":
            start, size, rank_index = 0, q, self.tp_rank
        else:
            start = q if shard_id == "k" else q + kv
            size, rank_index = kv, self.tp_rank // self.num_kv_replicas
        target = param.data.narrow(output_dim, start, size)
        shard = loaded.narrow(output_dim, rank_index * size, size)
        _copy_into(target, shard, f"{self.prefix} ({shard_id})")


class RowParallelLinear(LinearBase):
    """`y = x W^T + b` with W's input columns split across ranks: each rank multiplies its
    slice of x (the column-parallel layer's output) and the partial sums are all-reduced.
    The bias is added once, after the reduction."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        ctx: LayerContext,
        prefix: str,
        reduce_results: bool = True,
    ) -> None:
        per_rank = divide(input_size, ctx.tp_size, f"input size of {type(self).__name__}")
        super().__init__(input_size, output_size, per_rank, output_size, bias, ctx, prefix)
        self.reduce_results = reduce_results

    def lora_input_slice(self) -> tuple[int, int] | None:
        return (self.tp_rank * self.input_size_per_rank, self.input_size_per_rank) if self.tp_size > 1 else None

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        _, input_dim = _shard_dims(param, self.output_size_per_rank)
        if input_dim is None or loaded.dim() == 0:
            _copy_into(param.data, loaded, self.prefix)
            return
        size = param.shape[input_dim]
        _copy_into(param.data, loaded.narrow(input_dim, self.tp_rank * size, size), self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, input_size_per_rank] -> y: [num_tokens, output_size]
        if self.tp_size == 1:
            return self._with_lora(self.quant_method.apply(self, x, self.bias), x)
        # each rank's LoRA term is partial (its input columns), summed by the all-reduce
        y = self._with_lora(self.quant_method.apply(self, x, None), x)
        if self.reduce_results:
            y = self.communicator.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
