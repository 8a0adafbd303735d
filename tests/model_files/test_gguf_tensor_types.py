"""Every GGML tensor type the loader supports, against `gguf.quants` (llama.cpp's own
reference): quantized floats come back within the type's error, and raw K-quant blocks
dequantize exactly as gguf.quants does, so a mislabelled type fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from portaserve.framework.gguf import open_gguf
from portaserve.framework.gguf.weights import SUPPORTED_TENSOR_TYPES, dequantize_tensor, iter_gguf_weights

from .gguf_files import add_tensor, finish, write_decoder

# the largest error per element relative to the row's largest magnitude, for N(0, 1) data
QUANTIZABLE = {"F32": 0.0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 1e-2, "Q5_1": 4e-2, "Q5_0": 5e-2, "Q4_1": 8e-2,
               "Q4_0": 1e-1}
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# byte offsets of the float16 scales (d, dmin) inside one 256-value block of each K-quant
_K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def test_the_covered_types_are_the_supported_types():
    assert set(QUANTIZABLE) | set(K_QUANTS) == set(SUPPORTED_TENSOR_TYPES)


def random_k_blocks(type_name: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random bytes for `rows` x `cols` values of a K-quant, with finite float16 scales."""
    block_size, type_size = quants.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[type_name]:
        scales = (rng.normal(0, 0.01, size=(rows, cols // block_size)) + 0.02).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, cols // block_size, 2)
    return blocks.reshape(rows, -1)


@pytest.fixture(scope="module")
def typed_file(tmp_path_factory):
    """One file with a 8 x 512 matrix of every supported type."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("types") / "types.gguf"
    writer = GGUFWriter(str(path), "llama")
    originals, raws = {}, {}
    for type_name in QUANTIZABLE:
        value = rng.normal(size=(8, 512)).astype(np.float32)
        originals[type_name] = value
        add_tensor(writer, f"{type_name}.weight", value, type_name)
    for type_name in K_QUANTS:
        raws[type_name] = random_k_blocks(type_name, 8, 512, rng)
        writer.add_tensor(f"{type_name}.weight", raws[type_name], raw_dtype=GGMLQuantizationType[type_name])
    finish(writer)
    return path, originals, raws


@pytest.mark.parametrize("type_name", list(QUANTIZABLE))
def test_quantized_floats_load_within_the_types_error(typed_file, type_name):
    path, originals, _ = typed_file
    tensor = next(t for t in open_gguf(path).tensors if t.name == f"{type_name}.weight")
    assert tensor.type_name == type_name and tensor.shape == (8, 512)
    loaded = dequantize_tensor(tensor).float().numpy()
    original = originals[type_name]
    error = np.abs(loaded - original).max() / np.abs(original).max()
    assert error <= QUANTIZABLE[type_name], error
    if type_name != "F32":
        assert error > 0  # it really went through the type


@pytest.mark.parametrize("type_name", K_QUANTS)
def test_k_quant_blocks_load_to_gguf_quants_dequantization(typed_file, type_name):
    path, _, raws = typed_file
    tensor = next(t for t in open_gguf(path).tensors if t.name == f"{type_name}.weight")
    assert tensor.type_name == type_name and tensor.shape == (8, 512)
    expected = quants.dequantize(raws[type_name], GGMLQuantizationType[type_name])
    loaded = dequantize_tensor(tensor).numpy()
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    np.testing.assert_array_equal(loaded, expected)
    # any other K-quant reading of the same bytes gives other values (or another size)
    for other in K_QUANTS:
        if other == type_name:
            continue
        try:
            with np.errstate(all="ignore"):
                wrong = quants.dequantize(raws[type_name], GGMLQuantizationType[other])
        except Exception:
            continue
        assert wrong.shape != expected.shape or not np.array_equal(wrong, expected)


def test_weights_come_out_under_hf_names_with_q_and_k_unpermuted(tmp_path):
    file = write_decoder(tmp_path / "m.gguf", matrix_type="F32", heads=4, kv_heads=2)
    gguf = open_gguf(file)
    by_name = {t.name: t for t in gguf.tensors}
    weights = dict(iter_gguf_weights(gguf))
    assert "model.layers.0.self_attn.q_proj.weight" in weights and "model.embed_tokens.weight" in weights
    stored_q = torch.from_numpy(np.array(by_name["blk.0.attn_q.weight"].data))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    # llama.cpp's converter permutes with (n_head, 2, d/2) -> (n_head, d/2, 2): redo it on ours
    head_dim = q.shape[0] // 4
    repermuted = q.reshape(4, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(q.shape)
    assert torch.equal(repermuted, stored_q) and not torch.equal(q, stored_q)
    stored_v = torch.from_numpy(np.array(by_name["blk.0.attn_v.weight"].data))
    assert torch.equal(weights["model.layers.0.self_attn.v_proj.weight"], stored_v)
