"""Structured outputs' token mask on the device: logits of disallowed tokens set to -inf,
in place. Grid: (row, block of tokens); each program reads the bitmask words of its
block once. Reference: `framework.op_references.apply_token_bitmask`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: tokens per program (a multiple of 32: whole bitmask words)
BLOCK = 1024


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, mask_ptr, stride_l, stride_m, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    words = tl.load(mask_ptr + row * stride_m + tokens // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (tokens % 32)) & 1) != 0
    ptrs = logits_ptr + row * stride_l + tokens
    # only disallowed tokens are written: most of a JSON grammar's vocabulary is masked,
    # but rows without a grammar (all bits set) write nothing
    tl.store(ptrs, tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty), mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """:param logits: [rows, vocab], written in place (returned)
    :param bitmask: [rows, ceil(vocab / 32)] int32 on the same device"""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    bitmask = bitmask.to(device=logits.device, dtype=torch.int32).contiguous()
    grid = (rows, triton.cdiv(vocab, BLOCK))
    _apply_token_bitmask_kernel[grid](logits, bitmask, logits.stride(0), bitmask.stride(0), vocab, BLOCK=BLOCK)
    return logits
