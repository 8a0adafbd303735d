"""GGUF quantized blocks as integer codes with a scale and an offset per 16 weights.

Every GGML block type this module knows stores, for each weight, an unsigned integer
code `q` and, for each run of 16 or 32 weights, a float scale `d` and offset `m`, with
the weight equal to `d * q + m` (the signed types fold their zero point into `m`: Q8_0's
`d * (q - 128)` is `d * q - 128 d`). `decompose` reads a tensor's raw blocks into that
common form, exactly:

    codes:  uint8   [rows, cols]        (0..255; 0..15 for the 4-bit types)
    scales: float32 [rows, cols // 16]
    mins:   float32 [rows, cols // 16]

Sixteen divides every type's sub-block, so one layout holds all of them; a kernel
repacks it (4-bit nibbles, 32-wide groups where pairs of scales agree) for its own
loops. The bit layouts follow ggml's `dequantize_row_*` (ggml-quants.c); the tests
compare `codes * scales + mins` with `gguf.quants.dequantize` for every type.
"""

from __future__ import annotations

import numpy as np

#: GGML types `decompose` handles -> (weights per block, bytes per block)
BLOCK_TYPES: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}

GROUP = 16

#: byte offsets of each type's float16 fields inside one block (`random_blocks` keeps them finite)
F16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def _f16(raw: np.ndarray) -> np.ndarray:
    """[nblocks, 2] uint8 -> [nblocks, 1] float32 (little-endian half floats)."""
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32]: the low nibbles are weights 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _per_group(values: np.ndarray, group: int) -> np.ndarray:
    """[n, k] per-`group` values -> [n, k * group // 16] per-16 values."""
    return np.repeat(values, group // GROUP, axis=-1)


def _q8_0(b):
    d = _f16(b[:, 0:2])
    codes = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, _per_group(d, 32), _per_group(-128 * d, 32)


def _q4_0(b):
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18]), _per_group(d, 32), _per_group(-8 * d, 32)


def _q4_1(b):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return _nibbles(b[:, 4:20]), _per_group(d, 32), _per_group(m, 32)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes of a little-endian uint32 -> [n, 32]: bit j of it, times 16."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # bit j of the uint32 at index j
    return bits.astype(np.uint8) << 4


def _q5_0(b):
    d = _f16(b[:, 0:2])
    codes = _nibbles(b[:, 6:22]) | _high_bits(b[:, 2:6])
    return codes, _per_group(d, 32), _per_group(-16 * d, 32)


def _q5_1(b):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    codes = _nibbles(b[:, 8:24]) | _high_bits(b[:, 4:8])
    return codes, _per_group(d, 32), _per_group(m, 32)


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins -> [n, 8] each (ggml's get_scale_min_k4)."""
    s = s.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 128] bytes -> [n, 256] codes: chunk j of 32 bytes holds sub-block 2j in its
    low nibbles and sub-block 2j + 1 in its high ones."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(-1, 256)


def _q4_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales_mins(b[:, 4:16])
    codes = _k_low_nibbles(b[:, 16:144])
    return codes, _per_group(d * sc, 32), _per_group(-dmin * mn, 32)


def _q5_k(b):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales_mins(b[:, 4:16])
    qh = b[:, 16:48]  # bit j of byte l: the fifth bit of weight l of sub-block j
    high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4  # [n, 8, 32]
    codes = _k_low_nibbles(b[:, 48:176]) | high.reshape(-1, 256)
    return codes, _per_group(d * sc, 32), _per_group(-dmin * mn, 32)


def _q6_k(b):
    ql = b[:, 0:128].reshape(-1, 2, 64)  # two halves of 128 weights
    qh = b[:, 128:192].reshape(-1, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16], one per 16 weights
    d = _f16(b[:, 208:210])
    low = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)  # [n, 2, 128]
    codes = (low | (high << 4)).reshape(-1, 256)
    scale = d * sc
    return codes, scale, -32 * scale


_DECOMPOSE = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def decompose(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scales, mins) of a 2-D tensor stored as GGML `type_name` blocks.

    :param raw: the tensor's bytes (uint8, any shape; GGUFReader's [rows, row_bytes]).
    :param shape: (rows, cols) in torch order.
    """
    rows, cols = shape
    per_block, block_bytes = BLOCK_TYPES[type_name]
    if cols % per_block:
        raise ValueError(f"a {type_name} row holds whole blocks of {per_block}; {cols} columns do not")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, block_bytes)
    if blocks.shape[0] != rows * cols // per_block:
        raise ValueError(f"{blocks.shape[0]} {type_name} blocks do not make a {rows} x {cols} tensor")
    codes, scales, mins = _DECOMPOSE[type_name](blocks)
    return (
        codes.reshape(rows, cols),
        scales.reshape(rows, cols // GROUP).astype(np.float32, copy=False),
        mins.reshape(rows, cols // GROUP).astype(np.float32, copy=False),
    )


def compose(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """The float32 weights `codes * scale + min` (the reference the kernels are tested against)."""
    rows, cols = codes.shape
    groups = codes.reshape(rows, cols // GROUP, GROUP).astype(np.float32)
    return (groups * scales[..., None] + mins[..., None]).reshape(rows, cols)


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """Random valid `type_name` blocks for a rows x cols tensor ([rows, row_bytes] uint8),
    for tests and benchmarks: any bytes make a block once its float16 fields are finite."""
    per_block, block_bytes = BLOCK_TYPES[type_name]
    blocks = rng.integers(0, 256, size=(rows * cols // per_block, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[type_name]:
        values = rng.normal(0, scale, size=(blocks.shape[0], 1)).astype("<f2")
        blocks[:, offset:offset + 2] = values.view(np.uint8)
    return blocks.reshape(rows, -1)
