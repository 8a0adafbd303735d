"""The packed layout of GGUF-quantized weights that every "gguf" kernel reads.

The loader hands a layer integer codes with a scale and an offset per 16 weights
(`framework.gguf.blocks`: w = scale * code + min). After loading they are packed once:

- `bits` 4 when every code fits in a nibble (Q4_0, Q4_1, Q4_K), else 8 (Q8_0, Q5_*, Q6_K):
  4-bit rows store each run of 32 weights in 16 bytes, byte j holding weight j in its
  low nibble and weight 16 + j in its high one (ggml's own Q4_0 order); 8-bit rows are
  the codes in order;
- `group` 32 where each pair of 16-wide scales and mins agree (every 32-wide type), else 16;
- scales and mins as float16 [rows, cols / group].

Q4_1 then takes 5 bits per weight, as in the file, and Q8_0 9 (8.5 in the file).
`dequantize_packed` is the torch reference every kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 16


@dataclass
class PackedGGUF:
    """One layer's packed weight: qweight [rows, cols / 2 or cols] uint8, scales and mins
    float16 [rows, cols / group]."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.qweight.shape
        return rows, width * (2 if self.bits == 4 else 1)


def _to_f16(values: torch.Tensor, what: str) -> torch.Tensor:
    half = values.to(torch.float16)
    if not torch.isfinite(half).all():
        raise ValueError(f"a GGUF {what} does not fit in float16 (largest magnitude {values.abs().max().item():g})")
    return half


def pack(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> PackedGGUF:
    """codes [rows, cols] uint8, scales / mins [rows, cols / 16] float -> the packed layout."""
    rows, cols = codes.shape
    if cols % 32:
        raise ValueError(f"GGUF rows hold whole blocks of 32 weights; {cols} columns do not")
    group = 16
    if torch.equal(scales[:, 0::2], scales[:, 1::2]) and torch.equal(mins[:, 0::2], mins[:, 1::2]):
        group, scales, mins = 32, scales[:, 0::2], mins[:, 0::2]
    if int(codes.max()) < 16:
        runs = codes.reshape(rows, cols // 32, 2, 16)
        qweight = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(rows, cols // 2)
        bits = 4
    else:
        qweight, bits = codes, 8
    return PackedGGUF(qweight.contiguous(), _to_f16(scales, "scale").contiguous(), _to_f16(mins, "min").contiguous(), bits, group)


def unpack(packed: PackedGGUF) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loader's layout back: (codes [rows, cols] uint8, scales, mins [rows, cols / 16] float32)."""
    q = packed.qweight
    rows, cols = packed.shape
    if packed.bits == 4:
        runs = q.reshape(rows, cols // 32, 1, 16)
        codes = torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(rows, cols)
    else:
        codes = q
    repeat = packed.group // GROUP
    return (
        codes.clone(),
        packed.scales.float().repeat_interleave(repeat, dim=1),
        packed.mins.float().repeat_interleave(repeat, dim=1),
    )


def compose(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """float32 [rows, cols] = codes * scale + min, scale and min per 16 weights."""
    rows, cols = codes.shape
    groups = codes.reshape(rows, cols // GROUP, GROUP).float()
    return (groups * scales.float()[..., None] + mins.float()[..., None]).reshape(rows, cols)


def dequantize_packed(packed: PackedGGUF) -> torch.Tensor:
    """The packed weight as float32 [rows, cols]."""
    return compose(*unpack(packed))


def reference_matmul(x: torch.Tensor, packed: PackedGGUF, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W^T (+ bias)` in float32 with W dequantized: the reference of every kernel."""
    y = x.float() @ dequantize_packed(packed).to(x.device).T
    return y if bias is None else y + bias.float()
