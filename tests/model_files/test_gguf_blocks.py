"""`framework.gguf.blocks`: every GGML type the quantized path keeps reads into codes,
scales and mins whose `code * scale + min` is exactly `gguf.quants.dequantize` (llama.cpp's
own reference), for random blocks (any bytes are a valid block once the float16 fields
are finite), and the loader's quantized mode yields them under the parameters' names."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from portaserve.framework.gguf import open_gguf
from portaserve.framework.gguf.blocks import BLOCK_TYPES, F16_FIELDS, compose, decompose, random_blocks
from portaserve.framework.gguf.weights import encode_8bit, iter_gguf_weights

from .gguf_files import write_decoder

REQUIRED = {"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"}  # issue #24's list


def test_every_required_type_is_covered():
    assert REQUIRED <= set(BLOCK_TYPES) and set(F16_FIELDS) == set(BLOCK_TYPES)


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
@pytest.mark.parametrize("rows", [1, 5])
def test_codes_times_scales_plus_mins_is_gguf_dequantize(type_name, rows):
    rng = np.random.default_rng(len(type_name) * 7 + rows)
    per_block = BLOCK_TYPES[type_name][0]
    cols = per_block * 3
    raw = random_blocks(type_name, rows, cols, rng)
    reference = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols)
    codes, scales, mins = decompose(raw, type_name, (rows, cols))
    assert codes.dtype == np.uint8 and scales.shape == mins.shape == (rows, cols // 16)
    np.testing.assert_array_equal(compose(codes, scales, mins), reference)
    # a 4-bit type's codes fit a nibble, so the kernels pack it in 4 bits
    assert codes.max() < {"Q4_0": 16, "Q4_1": 16, "Q4_K": 16, "Q5_0": 32, "Q5_1": 32, "Q5_K": 32, "Q6_K": 64}.get(type_name, 256)


def test_a_wrong_shape_is_refused():
    raw = random_blocks("Q8_0", 2, 64, np.random.default_rng(0))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        decompose(raw, "Q8_0", (2, 48))
    with pytest.raises(ValueError, match="do not make"):
        decompose(raw, "Q8_0", (3, 64))


def test_float_matrices_encode_to_8_bits_within_a_rounding_step():
    weight = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    codes, scale, low = encode_8bit(weight)
    back = compose(codes.numpy(), scale.numpy(), low.numpy())
    step = scale.repeat_interleave(16, dim=1).numpy()
    assert np.all(np.abs(back - weight.numpy()) <= 0.5 * step + 1e-6)


@pytest.mark.parametrize("matrix_type", ["Q8_0", "Q4_1", "F16"])
def test_the_loader_keeps_matrices_quantized_under_the_parameter_names(tmp_path, matrix_type):
    """Quantized mode: codes / _scale / _min per matrix (rows unpermuted like the float
    path; float matrices encoded to 8 bits), 1-D tensors as they are."""
    gguf = open_gguf(write_decoder(tmp_path / "tiny.gguf", matrix_type=matrix_type))
    dense = dict(iter_gguf_weights(gguf))
    packed = dict(iter_gguf_weights(gguf, keep_quantized=True))
    assert set(packed) == set(dense) | {n + s for n, v in dense.items() if v.dim() == 2 for s in ("_scale", "_min")}
    for name, value in dense.items():
        if value.dim() != 2:
            assert torch.equal(packed[name], value)
            continue
        codes, scale, low = packed[name], packed[name + "_scale"], packed[name + "_min"]
        assert codes.dtype == torch.uint8 and codes.shape == value.shape
        back = compose(codes.numpy(), scale.numpy(), low.numpy())
        atol = 0.5 * float(scale.max()) + 1e-6 if matrix_type == "F16" else 1e-6
        np.testing.assert_allclose(back, value.numpy(), rtol=0, atol=atol)
