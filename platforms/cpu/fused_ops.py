"""The CPU platform's fused layer ops (`fused_ops.c`), with the signatures of
`framework.interfaces.ops`; the plan binds them when a C compiler is present.

Each computes what the layer's own torch code computes, rounding where it rounds (see
fused_ops.c), and replaces its 3-10 torch ops (RMSNorm: a float32 copy, pow,
mean, add, rsqrt, two muls and two casts) by one pass over the data and one call, which
matters most at decode sizes, where the model's step is a long string of small ops.
If the library could not be built after all (the plan only saw that a compiler exists),
each op runs the same math in torch, so a bound op never fails for that reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from portaserve.platforms.cpu import native

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_workspace = torch.empty(0, dtype=torch.float32)
# workspaces outgrown: kept alive, since a recorded decode graph (graphs.py) may point at one
_retired: list[torch.Tensor] = []


def _kernels(*tensors: torch.Tensor) -> native.NativeKernels | None:
    kernels = native.load()
    if kernels is None or any(t.dtype != tensors[0].dtype or t.device.type != "cpu" for t in tensors):
        return None
    return kernels if tensors[0].dtype in _DTYPES else None


def _scratch(floats: int) -> torch.Tensor:
    """A float32 workspace of at least `floats` elements (kept between calls: one step at a time)."""
    global _workspace
    if _workspace.numel() < floats:
        _retired.append(_workspace)
        _workspace = torch.empty(floats, dtype=torch.float32)
    return _workspace


def fused_workspace_floats(h: int) -> int:
    """fused_ops.c's ps_fused_workspace_floats(h), without a ctypes call per op (tested equal)."""
    return 2 * h + 32


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with unit stride along the last dim (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rms(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, kernels):
    h = x.shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype)
    res_out = None
    res_ptr = res_out_ptr = None
    if residual is not None:
        residual = residual.reshape(rows, h).contiguous()
        res_out = torch.empty(x.shape, dtype=x.dtype)
        res_ptr, res_out_ptr = residual.data_ptr(), res_out.data_ptr()
    threads = torch.get_num_threads()
    ws = _scratch(threads * fused_workspace_floats(h))
    rc = kernels.rms_norm(x2.data_ptr(), x2.stride(0), res_ptr, res_out_ptr, out.data_ptr(), weight.contiguous().data_ptr(),
                          rows, h, eps, _DTYPES[x.dtype], ws.data_ptr(), threads)
    if rc != 0:
        raise RuntimeError(f"rms_norm: the C kernel rejected its arguments (code {rc})")
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: normalise in float32, round, scale by the weight (transformers' order)."""
    kernels = _kernels(x, weight)
    if kernels is None or x.numel() == 0:
        return _torch_rms_norm(x, weight, eps)
    return _rms(x, None, weight, eps, kernels)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the inputs are not modified."""
    kernels = _kernels(x, residual, weight)
    if kernels is None or x.numel() == 0:
        new_residual = x + residual
        return _torch_rms_norm(new_residual, weight, eps), new_residual
    return _rms(x, residual, weight, eps, kernels)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:], rounding after the silu and after the product (as torch)."""
    d = x.shape[-1] // 2
    kernels = _kernels(x)
    if kernels is None or x.numel() == 0:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    x2 = _rows(x)
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
    rc = kernels.silu_and_mul(x2.data_ptr(), x2.stride(0), out.data_ptr(), x2.shape[0], d, _DTYPES[x.dtype],
                              torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"silu_and_mul: the C kernel rejected its arguments (code {rc})")
    return out


def _torch_rotate(x: torch.Tensor, rows: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """The rotary layer's torch code: cos/sin in x's dtype, every op rounding in it."""
    rot_dim = rows.shape[-1]
    cos, sin = rows.to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = rot.chunk(2, dim=-1) if is_neox else (rot[..., 0::2], rot[..., 1::2])
    out1, out2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rotated = torch.cat((out1, out2), dim=-1) if is_neox else torch.stack((out1, out2), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads, head_size] and k [tokens, kv_heads, head_size] by the
    `cos_sin_cache` rows at `positions`, rounding as the layer's torch code does; new outputs."""
    kernels = _kernels(q, k)
    if kernels is None or q.numel() == 0 or cos_sin_cache.dtype != torch.float32:
        rows = cos_sin_cache.index_select(0, positions)
        return _torch_rotate(q, rows, is_neox), _torch_rotate(k, rows, is_neox)
    tokens, num_q_heads, head_size = q.shape
    num_k_heads = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    index = positions.to(torch.int64).contiguous()
    table = cos_sin_cache.contiguous()
    q_out = torch.empty((tokens, num_q_heads, head_size), dtype=q.dtype)
    k_out = torch.empty((tokens, num_k_heads, head_size), dtype=k.dtype)
    threads = torch.get_num_threads()
    ws = _scratch(threads * (3 * head_size + 16))
    rc = kernels.rotary(index.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                        q_out.data_ptr(), k_out.data_ptr(), table.data_ptr(), tokens, num_q_heads, num_k_heads, head_size,
                        table.shape[-1], int(is_neox), _DTYPES[q.dtype], ws.data_ptr(), threads)
    if rc != 0:
        raise RuntimeError(f"rotary_embedding: the C kernel rejected its arguments (code {rc})")
    return q_out, k_out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured outputs' mask in C (in place on float32 CPU logits): ~30x the torch
    reference, which unpacks every bit into a [rows, vocab] tensor first."""
    kernels = native.load()
    if kernels is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2:
        from portaserve.framework.op_references import apply_token_bitmask as reference

        return reference(logits, bitmask)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    mask = bitmask.to(dtype=torch.int32, device="cpu").contiguous()
    rc = kernels.apply_token_bitmask(logits.data_ptr(), logits.stride(0), mask.data_ptr(), mask.shape[1],
                                     logits.shape[0], logits.shape[1], torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"apply_token_bitmask: the C kernel rejected its arguments (code {rc})")
    return logits


#: tokens up to which LoRA runs in C (decode steps); longer steps group their tokens by
#: adapter and multiply with torch's (oneDNN) matmuls, where the work is matmul-sized
LORA_C_MAX_TOKENS = 64


def _grouped_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  token_slots: torch.Tensor) -> torch.Tensor:
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        y.index_add_(0, rows, (x.index_select(0, rows) @ lora_a[slot].t()) @ lora_b[slot])
    return y


def lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                token_slots: torch.Tensor) -> torch.Tensor:
    """LoRA adapters in C for a few tokens (lora.c: float32 accumulation, y rounded once, in
    place), grouped torch matmuls for more."""
    kernels = _kernels(y, x, lora_a, lora_b)
    tokens = y.shape[0]
    if (x.shape[-1] != lora_a.shape[-1] or y.shape[-1] != lora_b.shape[-1] or lora_a.shape[:2] != lora_b.shape[:2]
            or token_slots.shape != (tokens,)):
        raise ValueError(f"lora_linear: shapes y {tuple(y.shape)}, x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)}, "
                         f"lora_b {tuple(lora_b.shape)}, token_slots {tuple(token_slots.shape)} do not fit together")
    if (kernels is None or tokens > LORA_C_MAX_TOKENS or y.dim() != 2 or y.stride(-1) != 1 or x.stride(-1) != 1
            or not lora_a.is_contiguous() or not lora_b.is_contiguous()):
        return _grouped_lora(y, x, lora_a, lora_b, token_slots)
    slots = token_slots.to(device="cpu", dtype=torch.int64).contiguous()
    rank = lora_a.shape[1]
    ws = _scratch(tokens * (x.shape[1] + rank + 2) + 1)
    rc = kernels.lora_linear(y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), lora_a.data_ptr(), lora_b.data_ptr(),
                             slots.data_ptr(), tokens, x.shape[1], y.shape[1], rank, lora_a.shape[0], _DTYPES[y.dtype],
                             ws.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"lora_linear: the C kernel rejected its arguments (code {rc})")
    return y
