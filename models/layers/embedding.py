"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks.

The vocabulary is padded to a multiple of `tp_size` and rank r owns rows
[r * rows_per_rank, (r + 1) * rows_per_rank). The embedding looks up the ids it owns,
zeros the rest and all-reduces; the LM head computes its slice of the logits and
all-gathers them. With tied embeddings the LM head shares the embedding's parameter.

Where the plan's QuantMethod stores tables quantized (`QuantMethod.quantizes_embedding`:
a GGUF file's Q8_0 `token_embd`), the table is that method's parameters and a lookup
dequantizes only the rows asked for; a tied LM head multiplies by the same packed table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from portaserve.framework.layer_context import LayerContext


class VocabParallelEmbedding(nn.Module):
    """`weight: [rows_per_rank, embedding_dim]`, this rank's slice of the vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: LayerContext, prefix: str = "") -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = ctx.tp_rank
        self.tp_size = ctx.tp_size
        self.communicator = ctx.communicator
        self.prefix = prefix
        self.rows_per_rank = -(-num_embeddings // ctx.tp_size)
        self.vocab_start = ctx.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        # a quantized table: the method's parameters (codes, scales, ...), rows as above
        self.quant_method = ctx.embedding_method(prefix)
        if self.quant_method is not None:
            self.quant_method.create_weights(self, embedding_dim, self.rows_per_rank, ctx.dtype, False)
        else:
            self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim, dtype=ctx.dtype), requires_grad=False)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows of the full `[vocab, ...]` checkpoint tensor; padding rows are zero."""
        if loaded.dim() != param.dim() or loaded.shape[1:] != param.shape[1:] or loaded.shape[0] < self.num_embeddings:
            raise ValueError(
                f"{self.prefix}: checkpoint tensor has shape {tuple(loaded.shape)}, "
                f"expected ({self.num_embeddings}, {', '.join(map(str, param.shape[1:]))})"
            )
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, embedding_dim]
        if self.tp_size == 1:
            return self._lookup(input_ids)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(owned, input_ids - self.vocab_start, 0)
        out = self._lookup(local).masked_fill_(~owned.unsqueeze(-1), 0)
        return self.communicator.all_reduce(out)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embedding(self, ids)
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        quant = f", quant={self.quant_method.name}" if self.quant_method is not None else ""
        return f"rows {self.vocab_start}:{self.vocab_end} of {self.num_embeddings}, dim={self.embedding_dim}{quant}"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits, vocabulary split like the embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: LayerContext, prefix: str = "", bias: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim, ctx, prefix)
        self.bias = None
        self.tied_table: tuple[VocabParallelEmbedding, ...] = ()
        if self.quant_method is None:
            # the logits matmul runs through the unquantized method (a platform may repack the
            # weight for it); create_weights is not called: the weight is the embedding-shaped one
            self.quant_method = ctx.quant_method(prefix, unquantized=True)
        self.keep_dense_weight = False
        if bias:
            self.bias = nn.Parameter(torch.empty(self.rows_per_rank, dtype=ctx.dtype), requires_grad=False)
            self.bias.weight_loader = self._bias_loader

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings)."""
        if embedding.quant_method is not None:
            # a quantized table: multiply by the embedding's packed parameters (a tuple, so
            # it is not a second submodule); this head keeps no weight and no method of its own
            self.tied_table = (embedding,)
            for name, _ in list(self.named_parameters(recurse=False)):
                if name != "bias":
                    delattr(self, name)
            self.quant_method = None
            return
        self.weight = embedding.weight
        # the embedding looks rows up in it: a repacking method keeps the dense copy too
        self.keep_dense_weight = True

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise TypeError("ParallelLMHead is not an embedding lookup; call compute_logits(hidden)")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_tokens, embedding_dim] -> float32 logits [num_tokens, num_embeddings].

        The matmul runs in the model dtype (as transformers does) and only the result is
        widened, so the sampler works in float32.
        """
        if self.tied_table:
            table = self.tied_table[0]
            logits = table.quant_method.apply(table, hidden, self.bias)
        else:
            logits = self.quant_method.apply(self, hidden, self.bias)
        if self.tp_size > 1:
            logits = self.communicator.all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings].float()
