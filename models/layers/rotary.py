"""Rotary position embedding with a cos/sin cache, and the rope_scaling variants.

The inverse frequencies follow transformers' `modeling_rope_utils` operation for
operation (float32 math in the same order), so positions rotate by bit-identical
angles: types default, linear, dynamic (NTK), llama3 and yarn. The cache holds, per
position, cos in its first half and sin in its second (`[max_positions, rotary_dim]`,
float32), the layout the `rotary_embedding` op takes.

Dynamic NTK recomputes the base from the sequence length: transformers uses, for a
forward, the length the sequence has after it (positions + 1), never less than
max_position_embeddings. Here each sequence of a batch gets its own length, so a
batched step matches transformers running that sequence alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from portaserve.framework.errors import UnsupportedError
from portaserve.framework.layer_context import LayerContext, StepContext

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
DEFAULT_ROPE_THETA = 10000.0


def rope_parameters(hf_config: Mapping[str, Any], default_theta: float = DEFAULT_ROPE_THETA) -> dict[str, Any]:
    """The config's RoPE parameters in one dict, from either format transformers writes:
    `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (older)."""
    raw = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    params = dict(raw) if isinstance(raw, Mapping) else {}
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    params.pop("type", None)
    if params.get("rope_theta") is None:
        params["rope_theta"] = hf_config.get("rope_theta", default_theta)
    if "partial_rotary_factor" not in params and hf_config.get("partial_rotary_factor") is not None:
        params["partial_rotary_factor"] = hf_config["partial_rotary_factor"]
    if params["rope_type"] in ("llama3", "yarn"):
        # transformers prefers a top-level original_max_position_embeddings (Phi-3 style)
        top = hf_config.get("original_max_position_embeddings")
        if top is not None:
            params["original_max_position_embeddings"] = top
        params.setdefault("original_max_position_embeddings", hf_config.get("max_position_embeddings", 2048))
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedError(
            f"rope_scaling: rope type {params['rope_type']!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return params


def rope_max_positions(params: Mapping[str, Any], max_position_embeddings: int) -> int:
    """Longest context the scaled RoPE is meant for (vLLM's rule: linear, dynamic and yarn
    stretch the trained length by `factor`; llama3 configs already state the long length)."""
    kind = params["rope_type"]
    factor = float(params.get("factor") or 1.0)
    if kind in ("linear", "dynamic"):
        return int(max_position_embeddings * factor)
    if kind == "yarn":
        return max(max_position_embeddings, int(params["original_max_position_embeddings"] * factor))
    return max_position_embeddings


def _exponents(dim: int) -> torch.Tensor:
    # 2i / dim for the dim/2 rotating pairs (float32, as transformers)
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def compute_inv_freq(params: Mapping[str, Any], dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2] float32, attention scaling of cos/sin) for the rope type.

    For dynamic this is the unscaled frequency, used while a sequence is no longer than
    max_position_embeddings (see `dynamic_inv_freq`).
    """
    kind = params["rope_type"]
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** _exponents(dim))
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    factor = float(params["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed down by `factor`, short ones kept, the band between blended
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(params, dim, max_position_embeddings)
    raise UnsupportedError(f"rope_scaling: rope type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _yarn_inv_freq(params: Mapping[str, Any], dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # the dimension whose wavelength fits `num_rotations` turns in the original context
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def dynamic_inv_freq(params: Mapping[str, Any], dim: int, max_position_embeddings: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic-NTK inverse frequencies for sequences of length `seq_lens` [num_seqs]:
    [num_seqs, dim / 2] float32 (float32 scalar math, as transformers does with a tensor length)."""
    base = float(params["rope_theta"])
    factor = float(params["factor"])
    lengths = torch.maximum(seq_lens.to(torch.int64), torch.tensor(max_position_embeddings, dtype=torch.int64))
    scaled_base = base * ((factor * lengths / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (scaled_base.unsqueeze(-1) ** _exponents(dim).to(scaled_base.device))


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float) -> torch.Tensor:
    """[..., rotary_dim] = cat(cos, sin) of positions * inv_freq (float32)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    return torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their positions; one instance is shared by every layer.

    Per step the model calls `prepare(positions, step)` once, which returns the
    (lookup positions, cos/sin table) pair every layer's `forward` uses.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        params: Mapping[str, Any],
        ctx: LayerContext,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_size:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_size {head_size}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.params = dict(params)
        self.is_neox_style = is_neox_style
        self.is_dynamic = self.params["rope_type"] == "dynamic"
        self.max_positions = rope_max_positions(self.params, max_position_embeddings)
        # Frequencies are computed on the host, so every device rotates by the same angles.
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = compute_inv_freq(self.params, rotary_dim, max_position_embeddings)
            cache = cos_sin(torch.arange(self.max_positions), inv_freq, self.attention_scaling)
        # cos_sin_cache: [max_positions, rotary_dim] float32, cos then sin
        self.register_buffer("cos_sin_cache", cache.to(ctx.device), persistent=False)
        self._op = ctx.ops.get("rotary_embedding")

    def prepare(self, positions: torch.Tensor, step: StepContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(lookup positions [num_tokens], table) for this step: the cache, or for dynamic
        NTK past the trained length a table of per-token rows looked up by token index."""
        if not self.is_dynamic or positions.numel() == 0:
            return positions, self.cos_sin_cache
        if int(positions.max()) < self.max_position_embeddings:
            return positions, self.cos_sin_cache
        seq_lens, token_seq = _seq_lengths(positions, step)
        inv_freq = dynamic_inv_freq(self.params, self.rotary_dim, self.max_position_embeddings, seq_lens)
        table = cos_sin(positions, inv_freq[token_seq], 1.0)
        return torch.arange(positions.numel(), device=positions.device), table

    def prepare_mrope(self, positions: torch.Tensor, sections: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Multimodal RoPE (Qwen2-VL): positions [3, num_tokens] (temporal, height, width);
        the rotary frequencies are split into `sections` (summing to rotary_dim / 2), the
        i-th rotated by position row i % 3. Returns (lookup index, per-token table) for `forward`."""
        half = self.rotary_dim // 2
        if sum(sections) != half:
            raise ValueError(f"mrope_section {list(sections)} must sum to rotary_dim / 2 = {half}")
        select = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(sections)])
        rows = self.cos_sin_cache[positions.to(self.cos_sin_cache.device)]  # [3, num_tokens, rotary_dim]
        index = select.to(rows.device).repeat(2).view(1, 1, -1).expand(1, rows.shape[1], -1)
        table = rows.gather(0, index)[0]  # [num_tokens, rotary_dim]
        return torch.arange(positions.shape[1], device=positions.device), table

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
        """q: [num_tokens, num_heads, head_size], k: [num_tokens, num_kv_heads, head_size]."""
        index, table = rope
        # the op rotates the first table.shape[-1] (= rotary_dim) features of each head
        return self._op(index, q, k, table, self.is_neox_style)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, type={self.params['rope_type']}, max_positions={self.max_positions}"


def _seq_lengths(positions: torch.Tensor, step: StepContext | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(length after this step of each sequence [num_seqs], sequence index of each token [num_tokens]).

    A sequence's new tokens are its last ones, so its length is its last position + 1.
    """
    qsl = step.query_start_loc if step is not None else None
    if qsl is None:
        qsl = torch.tensor([0, positions.numel()])
    qsl = qsl.to(device=positions.device, dtype=torch.int64)
    query_lens = qsl[1:] - qsl[:-1]
    nonempty = query_lens > 0
    last = positions.index_select(0, (qsl[1:] - 1).clamp(min=0))
    seq_lens = torch.where(nonempty, last + 1, 0)
    token_seq = torch.repeat_interleave(torch.arange(query_lens.numel(), device=positions.device), query_lens)
    return seq_lens, token_seq
