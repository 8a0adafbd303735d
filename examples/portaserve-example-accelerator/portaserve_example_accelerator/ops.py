"""nova's ops: a new fused op declared with its torch reference, and nova's implementations.

``split_qkv_rope`` is what nova's Llama calls after the fused q/k/v projection: split the
projection into q, k and v heads and rotate q and k by their positions (neox or GPT-J
style), in one op, so a device can do it in one pass over the projection's output.
Declaring it (``portaserve_op_specs``) makes it an op every platform can run: wherever no
implementation is bound, the plan binds `split_qkv_rope_reference`. nova binds its own
(``portaserve_custom_ops``), and also implements the built-in ``silu_and_mul``.

The conformance kit compares each implementation with the reference on the spec's
sample inputs (`split_qkv_rope_samples`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from portaserve.framework.interfaces.ops import OpImpl, OpSpec

_HERE = "portaserve_example_accelerator.ops"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` features of every head of x: [t, heads, d]."""
    rotary_dim = 2 * cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    rotated = torch.cat((out1, out2), dim=-1) if is_neox else torch.stack((out1, out2), dim=-1).flatten(-2)
    return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # rows: [t, 1, rotary_dim] (cos then sin), in the activations' dtype as transformers rounds them
    rows = cos_sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
    cos, sin = rows.chunk(2, dim=-1)
    return cos, sin


def split_qkv_rope_reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused q/k/v projection into heads and rotate q and k.

    :param qkv: [t, (num_heads + 2 * num_kv_heads) * head_size], q then k then v
    :param positions: [t] int64, each token's row of `cos_sin_cache`
    :param cos_sin_cache: [max_positions, rotary_dim] float32, cos in the first half, sin in the second
    :returns: q [t, num_heads, head_size], k [t, num_kv_heads, head_size] (both rotated), v like k
    """
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    cos, sin = _cos_sin(positions, cos_sin_cache, qkv.dtype)
    q = _rotate(q.reshape(t, num_heads, head_size), cos, sin, is_neox)
    k = _rotate(k.reshape(t, num_kv_heads, head_size), cos, sin, is_neox)
    return q, k, v.reshape(t, num_kv_heads, head_size)


def nova_split_qkv_rope(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_size, is_neox):
    """nova's implementation: q and k heads rotated together, as one tensor (one pass)."""
    t = qkv.shape[0]
    qk_heads = num_heads + num_kv_heads
    qkv = qkv.contiguous()
    # views into the projection: no copy before the rotation
    qk = qkv[:, : qk_heads * head_size].view(t, qk_heads, head_size)
    v = qkv[:, qk_heads * head_size :].view(t, num_kv_heads, head_size)
    cos, sin = _cos_sin(positions, cos_sin_cache, qkv.dtype)
    qk = _rotate(qk, cos, sin, is_neox)
    return qk[:, :num_heads], qk[:, num_heads:], v


def nova_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The built-in op ``silu_and_mul`` (x: [..., 2d] -> silu(x[..., :d]) * x[..., d:]) on nova."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def split_qkv_rope_samples(device: torch.device, dtype: torch.dtype, gen: torch.Generator):
    """Inputs the kit runs implementations and the reference on: GQA, MHA, MQA; neox and
    GPT-J style; full and partial rotary dims."""
    out = []
    for tokens, heads, kv_heads, head_size, rotary_dim, neox in (
        (3, 4, 2, 32, 32, True),
        (9, 8, 8, 64, 32, False),
        (1, 4, 1, 128, 128, True),
        (17, 8, 2, 64, 64, True),
    ):
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
        freqs = torch.arange(256).float().unsqueeze(-1) * inv_freq
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
        positions = torch.randint(0, 256, (tokens,), generator=gen).to(device)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype=dtype, device=device)
        out.append((qkv, positions, cache, heads, kv_heads, head_size, neox))
    return out


OP_SPECS = (
    OpSpec(
        name="split_qkv_rope",
        signature="split_qkv_rope(qkv: [t, (heads + 2 * kv_heads) * d], positions: [t], cos_sin_cache: "
        "[positions, rot] float32, num_heads, num_kv_heads, head_size, is_neox) -> (q [t, heads, d], "
        "k [t, kv_heads, d], v [t, kv_heads, d]), q and k rotated",
        reference=split_qkv_rope_reference,
        sample_inputs=f"{_HERE}:split_qkv_rope_samples",
    ),
)

OP_IMPLS = (
    OpImpl(op="split_qkv_rope", name="nova", platforms=frozenset({"nova"}), fn=f"{_HERE}:nova_split_qkv_rope", priority=10),
    OpImpl(op="silu_and_mul", name="nova", platforms=frozenset({"nova"}), fn=f"{_HERE}:nova_silu_and_mul", priority=10),
)
