"""RMSNorm, alone and fused with the residual add that precedes it in a decoder layer.

`out = x / sqrt(mean(x^2) + eps) * weight`, computed in float32 and rounded once.
The fused form first forms `new_residual = (x + residual)` rounded to the activation
dtype — the value the next layer adds to — and normalizes exactly that value, so the
fused and unfused paths give the same numbers.

One program per row, the whole row in one tile: rows are at most a few thousand
elements (hidden sizes, or head_size for q/k norms), so a single pass keeps the row
in registers; wider rows are refused rather than silently slow.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpret import fix_interpreter_bf16_dot

fix_interpreter_bf16_dot()

MAX_COLS = 32768


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    num_cols,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        z = (x + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, z, mask=mask)
        x = z.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / num_cols
    inv_rms = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View `t` as [rows, cols] without copying when its rows are evenly strided."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1])


def _output(given: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor:
    if given is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if given.shape != like.shape or not given.is_contiguous():
        raise ValueError(f"{name} must be a contiguous tensor of shape {tuple(like.shape)}")
    return given


def _launch(x, residual, weight, eps, out=None, residual_out=None):
    cols = x.shape[-1]
    if weight.shape != (cols,):
        raise ValueError(f"weight must be [{cols}], got {tuple(weight.shape)}")
    if cols > MAX_COLS:
        raise ValueError(f"rms_norm supports rows of at most {MAX_COLS} elements, got {cols}")
    x2 = _rows(x)
    out = _output(out, x, "out")
    out2 = out.view(-1, cols)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        r2 = _rows(residual)
        new_residual = _output(residual_out, residual, "residual_out")
        ro2 = new_residual.view(-1, cols)
    else:
        r2 = ro2 = x2
        new_residual = None
    num_rows = x2.shape[0]
    if num_rows:
        block = triton.next_power_of_2(cols)
        _rms_norm_kernel[(num_rows,)](
            x2,
            r2,
            weight,
            out2,
            ro2,
            x2.stride(0),
            r2.stride(0),
            out2.stride(0),
            ro2.stride(0),
            cols,
            float(eps),
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            # about 8 elements per lane: enough loads in flight without spilling
            num_warps=max(1, min(16, block // 256)),
        )
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension.

    :param x: [..., hidden]
    :param weight: [hidden]
    :param out: optional contiguous [..., hidden] buffer to write into
    :returns: [..., hidden] in x's dtype
    """
    out, _ = _launch(x, None, weight, eps, out)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`new_residual = x + residual; out = rms_norm(new_residual)`.

    :param x: [..., hidden]
    :param residual: [..., hidden]
    :param out, residual_out: optional contiguous buffers for the two results
    :returns: (out [..., hidden], new_residual [..., hidden]); the inputs are not modified.
    """
    out, new_residual = _launch(x, residual, weight, eps, out, residual_out)
    return out, new_residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference: float64 math, returns float64."""
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def fused_add_rms_norm_ref(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: float64 math, returns (out, new_residual) in float64."""
    z = x.double() + residual.double()
    return rms_norm_ref(z, weight, eps), z
