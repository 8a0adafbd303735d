"""The ops portaserve declares: their torch references and the kit's sample inputs.

The references compute like transformers (normalize in float32, round to the activation
dtype, then scale), so a model running them is token-identical to transformers; they are
what runs wherever a platform binds no implementation of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .interfaces.ops import OpSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden]; weight: [hidden] -> [..., hidden]."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool):
    """Rotate the first `rotary_dim` (= cos_sin_cache.shape[-1]) features of every head.

    positions: [num_tokens] rows of cos_sin_cache ([max_positions, rotary_dim] float32,
    cos then sin); q: [num_tokens, num_heads, head_size]; k: [num_tokens, num_kv_heads,
    head_size]. Neox style rotates the two halves, GPT-J style interleaved pairs.
    """
    rows = cos_sin_cache.index_select(0, positions).to(q.dtype).unsqueeze(1)
    cos, sin = rows.chunk(2, dim=-1)
    rotary_dim = cos_sin_cache.shape[-1]
    return _rotate(q, cos, sin, rotary_dim, is_neox), _rotate(k, cos, sin, rotary_dim, is_neox)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, is_neox: bool) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    rotated = torch.cat((out1, out2), dim=-1) if is_neox else torch.stack((out1, out2), dim=-1).flatten(-2)
    return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured outputs' mask: logits [rows, vocab]; bitmask [rows, ceil(vocab / 32)] int32,
    bit j of word i set when token 32 * i + j is allowed -> logits with every other token at -inf."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)[..., :vocab]
    return logits.masked_fill(~allowed, float("-inf"))


def lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                token_slots: torch.Tensor) -> torch.Tensor:
    """LoRA adapters over one linear layer, mixed in a batch (punica / S-LoRA's grouping):
    y [t, out] plus, for each token whose slot s = token_slots[t] >= 0, (x[t] A_s^T) Bt_s,
    with x [t, in], lora_a [slots, rank, in] (PEFT's A), lora_b [slots, rank, out] (PEFT's
    B transposed, the scaling folded in: the expansion then reads rows of outputs) and
    token_slots [t] int64 (-1: no adapter). Accumulates in float32, returns y's dtype."""
    out = y.float()
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        shrunk = x.index_select(0, rows).float() @ lora_a[slot].float().t()
        out.index_add_(0, rows, shrunk @ lora_b[slot].float())
    return out.to(y.dtype)


# ----- sample inputs for the conformance kit ------------------------------------------


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def norm_samples(device, dtype, gen):
    out = []
    for tokens, hidden in ((1, 64), (7, 128), (33, 576)):
        x = _randn(gen, tokens, hidden, dtype=dtype, device=device)
        w = (1 + 0.1 * _randn(gen, hidden, dtype=torch.float32, device=device)).to(dtype)
        out.append((x, w, 1e-6))
    return out


def add_norm_samples(device, dtype, gen):
    return [(x, _randn(gen, *x.shape, dtype=dtype, device=device), w, eps) for x, w, eps in norm_samples(device, dtype, gen)]


def gated_samples(device, dtype, gen):
    return [(_randn(gen, tokens, 2 * d, dtype=dtype, device=device),) for tokens, d in ((1, 64), (5, 256), (17, 1536))]


def rotary_samples(device, dtype, gen):
    out = []
    for tokens, heads, kv_heads, head_size, rotary_dim, neox in ((3, 4, 2, 64, 64, True), (9, 8, 8, 128, 64, False), (1, 9, 3, 64, 64, True)):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
        freqs = torch.arange(256).float().unsqueeze(-1) * inv_freq
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
        positions = torch.randint(0, 256, (tokens,), generator=gen).to(device)
        q = _randn(gen, tokens, heads, head_size, dtype=dtype, device=device)
        k = _randn(gen, tokens, kv_heads, head_size, dtype=dtype, device=device)
        out.append((positions, q, k, cache, neox))
    return out


def bitmask_samples(device, dtype, gen):
    out = []
    for rows, vocab in ((1, 100), (3, 1000), (5, 32005)):
        logits = _randn(gen, rows, vocab, dtype=dtype, device=device)
        words = (vocab + 31) // 32
        bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
        bitmask[0] = -1  # a row that allows everything (a request without a grammar)
        out.append((logits, bitmask.to(device)))
    return out


def lora_samples(device, dtype, gen):
    out = []
    for tokens, slots, rank, d_in, d_out in ((1, 1, 8, 64, 96), (7, 3, 16, 128, 64), (33, 4, 16, 96, 320)):
        y = _randn(gen, tokens, d_out, dtype=dtype, device=device)
        x = _randn(gen, tokens, d_in, dtype=dtype, device=device)
        a = (0.1 * _randn(gen, slots, rank, d_in, dtype=torch.float32, device=device)).to(dtype)
        b = (0.1 * _randn(gen, slots, rank, d_out, dtype=torch.float32, device=device)).to(dtype)
        token_slots = torch.randint(-1, slots, (tokens,), generator=gen).to(device)
        out.append((y, x, a, b, token_slots))
    return out


_HERE = "portaserve.framework.op_references"

BUILTIN_OP_SPECS = (
    OpSpec("rms_norm", "rms_norm(x: [..., h], weight: [h], eps: float) -> [..., h]", rms_norm, f"{_HERE}:norm_samples"),
    OpSpec(
        "fused_add_rms_norm",
        "fused_add_rms_norm(x: [..., h], residual: [..., h], weight: [h], eps) -> (rms_norm(x + residual), x + residual)",
        fused_add_rms_norm, f"{_HERE}:add_norm_samples", mutates_inputs=True,
    ),
    OpSpec("silu_and_mul", "silu_and_mul(x: [..., 2d]) -> silu(x[..., :d]) * x[..., d:]", silu_and_mul, f"{_HERE}:gated_samples"),
    OpSpec(
        "rotary_embedding",
        "rotary_embedding(positions: [t], q: [t, heads, d], k: [t, kv_heads, d], cos_sin_cache: [positions, rot] "
        "float32, is_neox: bool) -> (q, k) rotated",
        rotary_embedding, f"{_HERE}:rotary_samples", mutates_inputs=True,
    ),
    OpSpec(
        "apply_token_bitmask",
        "apply_token_bitmask(logits: [rows, vocab], bitmask: [rows, ceil(vocab/32)] int32) -> logits, disallowed "
        "tokens at -inf (op 1.5)",
        apply_token_bitmask, f"{_HERE}:bitmask_samples", tolerances={torch.float32: 0.0, torch.bfloat16: 0.0,
                                                                     torch.float16: 0.0}, mutates_inputs=True,
    ),
    OpSpec(
        "lora_linear",
        "lora_linear(y: [t, out], x: [t, in], lora_a: [slots, rank, in], lora_b: [slots, rank, out], token_slots: "
        "[t] int64, -1 for none) -> y + (x A_s^T) lora_b_s per token's slot s (op 1.6)",
        lora_linear, f"{_HERE}:lora_samples", mutates_inputs=True,
    ),
)
