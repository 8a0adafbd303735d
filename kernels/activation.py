"""SiLU-and-mul, the gated MLP's activation: `silu(x[..., :d]) * x[..., d:]`.

Computed in float32 and rounded once. Grid: (row, column tile), so wide
intermediate sizes spread over many programs even for a single decode token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpret import fix_interpreter_bf16_dot

fix_interpreter_bf16_dot()

#: Columns per program: 1024 keeps a decode step's row spread over several programs.
BLOCK_COLS = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """:param x: [..., 2 * d] (gate, then up).
    :param out: optional contiguous [..., d] buffer to write into.
    :returns: [..., d] in x's dtype."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension, got {x.shape[-1]}")
    d = x.shape[-1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.reshape(-1, 2 * d)
    shape = (*x.shape[:-1], d)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of shape {shape}")
    out2 = out.view(-1, d)
    if x2.shape[0] and d:
        block = min(BLOCK_COLS, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=block, num_warps=4 if block >= 512 else 1
        )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference in float64."""
    d = x.shape[-1] // 2
    xd = x.double()
    return torch.nn.functional.silu(xd[..., :d]) * xd[..., d:]
