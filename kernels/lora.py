"""LoRA adapters over one linear layer on the device, mixed in a batch (the `lora_linear`
op; reference: `framework.op_references.lora_linear`).

Two kernels, as punica's shrink / expand:
- shrink: grid (token, ): the token's slot s; shrunk[t] = A_s x[t] in float32, the rank
  padded to a power of two, `in` walked in blocks;
- expand: grid (token, block of outputs): y[t, block] += shrunk[t] Bt_s[:, block],
  accumulated in float32 and rounded once; tokens without an adapter (-1) return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_IN = 128
BLOCK_OUT = 128


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, stride_x, d_in, rank,
                   RANK: tl.constexpr, BLOCK_IN: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s = tl.load(slots_ptr + t)
    if s < 0:
        return
    r = tl.arange(0, RANK)
    acc = tl.zeros([RANK], dtype=tl.float32)
    for start in range(0, d_in, BLOCK_IN):
        cols = start + tl.arange(0, BLOCK_IN)
        x = tl.load(x_ptr + t * stride_x + cols, mask=cols < d_in, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + (s * rank + r[:, None]) * d_in + cols[None, :],
                    mask=(r[:, None] < rank) & (cols[None, :] < d_in), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(out_ptr + t * RANK + r, acc)


@triton.jit
def _expand_kernel(y_ptr, b_ptr, slots_ptr, shrunk_ptr, stride_y, d_out, rank,
                   RANK: tl.constexpr, BLOCK_OUT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s = tl.load(slots_ptr + t)
    if s < 0:
        return
    cols = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    r = tl.arange(0, RANK)
    w = tl.load(shrunk_ptr + t * RANK + r)
    b = tl.load(b_ptr + (s * rank + r[:, None]) * d_out + cols[None, :],
                mask=(r[:, None] < rank) & (cols[None, :] < d_out), other=0.0).to(tl.float32)
    term = tl.sum(b * w[:, None], axis=0)
    ptrs = y_ptr + t * stride_y + cols
    y = tl.load(ptrs, mask=cols < d_out, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + term).to(y_ptr.dtype.element_ty), mask=cols < d_out)


def lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                token_slots: torch.Tensor) -> torch.Tensor:
    """:param y: [t, out], written in place (returned); x [t, in]; lora_a [slots, rank, in];
    lora_b [slots, rank, out]; token_slots [t] int64 (-1: no adapter)."""
    tokens, d_out = y.shape
    if tokens == 0:
        return y
    if y.stride(-1) != 1:
        y = y.contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    rank, d_in = lora_a.shape[1], lora_a.shape[2]
    padded = triton.next_power_of_2(rank)
    slots = token_slots.to(device=y.device, dtype=torch.int64).contiguous()
    shrunk = torch.empty((tokens, padded), dtype=torch.float32, device=y.device)
    _shrink_kernel[(tokens,)](x, lora_a, slots, shrunk, x.stride(0), d_in, rank, RANK=padded, BLOCK_IN=BLOCK_IN)
    _expand_kernel[(tokens, triton.cdiv(d_out, BLOCK_OUT))](y, lora_b, slots, shrunk, y.stride(0), d_out, rank,
                                                             RANK=padded, BLOCK_OUT=BLOCK_OUT)
    return y
