"""The CPU's GGUF matmul and embedding kernels (gguf_matmul.c) against the reference:
`gguf.quants.dequantize` of the same blocks, then a float64 matmul. Built for this CPU
(the AVX512-VNNI int8 path here) and portable (`-march=x86-64-v3`: the float loop), for
every type, 4- and 8-bit packings, 16- and 32-wide groups, odd shapes and 1..130 rows."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from portaserve.framework.gguf.blocks import BLOCK_TYPES, decompose, random_blocks
from portaserve.framework.quantization.gguf_layout import dequantize_packed, pack, reference_matmul, unpack
from portaserve.platforms.cpu import native
from portaserve.platforms.cpu.gguf_linear import gguf_matmul

pytestmark = pytest.mark.skipif(not native.enabled(), reason="no C compiler: the C kernels cannot be built")


def _variants():
    return ["native", "x86-64-v3"] if platform.machine() in ("x86_64", "AMD64") else ["native"]


@pytest.fixture(scope="module", params=_variants())
def kernels(request):
    return native.build(request.param)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


# int8 activations with a scale per 32 values (VNNI; llama.cpp's Q8 blocks) cost ~0.5-1.1%
# on these N(0, 1) inputs; bf16 outputs add their rounding
TOL = {torch.float32: 1.5e-2, torch.bfloat16: 2e-2, torch.float16: 1.5e-2}


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
def test_every_type_matches_gguf_dequantize_then_matmul(kernels, type_name):
    rng = np.random.default_rng(3)
    per_block = BLOCK_TYPES[type_name][0]
    n, k = 37, per_block * (3 if per_block == 32 else 2)  # odd row count; K not a multiple of 64 for 32-blocks
    raw = random_blocks(type_name, n, k, rng)
    weight = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k).astype(np.float64))
    packed = pack(*(torch.from_numpy(p) for p in decompose(raw, type_name, (n, k))))
    assert packed.bits == (4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8)
    assert packed.group == (16 if type_name == "Q6_K" else 32)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    for m in (1, 4, 5):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m), dtype=torch.float64)
        ref = x @ weight.T + bias.double()
        for dtype in (torch.float32, torch.bfloat16):
            out = gguf_matmul(kernels, x.to(dtype), packed, bias)
            assert out.dtype == dtype and out.shape == (m, n)
            assert rel(out, ref) < TOL[dtype], (type_name, m, dtype, rel(out, ref))


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 16), (8, 32), (8, 16)])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 576, 576), (3, 7, 96), (130, 33, 160), (2, 64, 32)])
def test_packings_and_shapes(kernels, bits, group, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    top = 16 if bits == 4 else 256
    codes = torch.randint(0, top, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.002).repeat_interleave(group // 16, dim=1)
    mins = (-scales * top / 2 * torch.rand(n, k // group, generator=gen).repeat_interleave(group // 16, dim=1))
    packed = pack(codes, scales, mins)
    assert (packed.bits, packed.group) == (bits, group)
    x = torch.randn(m, k, generator=gen)
    ref = reference_matmul(x, packed)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert rel(gguf_matmul(kernels, x.to(dtype), packed, None), ref) < TOL[dtype]
    # a strided view of rows (the model passes slices) reads the same
    wide = torch.randn(m, k + 32, generator=gen)
    assert rel(gguf_matmul(kernels, wide[:, :k], packed, None), reference_matmul(wide[:, :k], packed)) < TOL[torch.float32]


def test_the_portable_build_computes_in_float(kernels):
    """Without VNNI the kernel reads x in float: exact up to float32 sums."""
    gen = torch.Generator().manual_seed(0)
    packed = pack(torch.randint(0, 16, (16, 64), generator=gen, dtype=torch.uint8),
                  torch.full((16, 4), 0.01), torch.full((16, 4), -0.08))
    x = torch.randn(3, 64, generator=gen)
    err = rel(gguf_matmul(kernels, x, packed, None), reference_matmul(x, packed))
    assert err < (1.5e-2 if kernels.gguf_vnni() else 1e-6)


def test_embedding_rows_dequantize_exactly(kernels):
    rng = np.random.default_rng(0)
    raw = random_blocks("Q8_0", 50, 96, rng)
    packed = pack(*(torch.from_numpy(p) for p in decompose(raw, "Q8_0", (50, 96))))
    table = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0).reshape(50, 96))
    ids = torch.tensor([0, 49, 7, 7, 13])
    out = torch.empty(5, 96)
    assert kernels.gguf_embedding(ids.data_ptr(), 5, packed.qweight.data_ptr(), packed.bits, packed.group,
                                  packed.scales.data_ptr(), packed.mins.data_ptr(), 50, 96, out.data_ptr(), 0) == 0
    torch.testing.assert_close(out, table[ids], rtol=1e-3, atol=1e-6)  # the scales are float16, as in the file
    bad = torch.tensor([50])
    assert kernels.gguf_embedding(bad.data_ptr(), 1, packed.qweight.data_ptr(), packed.bits, packed.group,
                                  packed.scales.data_ptr(), packed.mins.data_ptr(), 50, 96, out.data_ptr(), 0) == -1


def test_pack_unpack_round_trip():
    gen = torch.Generator().manual_seed(0)
    for top, pairs in ((16, True), (16, False), (64, True), (256, False)):
        codes = torch.randint(0, top, (5, 96), generator=gen, dtype=torch.uint8)
        scales = torch.rand(5, 6, generator=gen).half().float()
        mins = -torch.rand(5, 6, generator=gen).half().float()
        if pairs:
            scales[:, 1::2], mins[:, 1::2] = scales[:, 0::2], mins[:, 0::2]
        packed = pack(codes, scales, mins)
        assert packed.group == (32 if pairs else 16) and packed.bits == (4 if top == 16 else 8)
        back = unpack(packed)
        assert torch.equal(back[0], codes) and torch.equal(back[1], scales) and torch.equal(back[2], mins)


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 16)])
def test_dequantize_matches_the_reference(kernels, bits, group):
    gen = torch.Generator().manual_seed(bits + group)
    top = 16 if bits == 4 else 256
    n, k = 33, 160
    codes = torch.randint(0, top, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=gen).half().float().repeat_interleave(group // 16, dim=1)
    mins = -torch.rand(n, k // group, generator=gen).half().float().repeat_interleave(group // 16, dim=1)
    packed = pack(codes, scales, mins)
    ref = dequantize_packed(packed)
    for dtype, code in ((torch.float32, 0), (torch.bfloat16, 1)):
        out = torch.empty(n, k, dtype=dtype)
        assert kernels.gguf_dequantize(packed.qweight.data_ptr(), packed.bits, packed.group, packed.scales.data_ptr(),
                                       packed.mins.data_ptr(), n, k, out.data_ptr(), code, 2) == 0
        torch.testing.assert_close(out.float(), ref, rtol=2 ** -8 if dtype == torch.bfloat16 else 0, atol=0)


def test_a_prefill_multiplies_through_the_dequantized_weight(kernels, monkeypatch):
    """From DEQUANTIZE_ROWS_F32 rows of float32 x the layer runs the platform GEMM on the expanded
    weight: the float matmul's result, without the int8 activations' error."""
    from torch import nn

    from portaserve.platforms.cpu import gguf_linear

    monkeypatch.setattr(native, "load", lambda: kernels)
    method = gguf_linear.CpuGGUFMethod()
    method.platform_features = frozenset({"c_kernels"})
    layer = nn.Module()
    method.create_weights(layer, 96, 40, torch.float32, True)
    tensors = gguf_linear.CpuGGUFMethod.conformance_weights(96, 40, torch.float32, torch.Generator().manual_seed(0))
    for name in ("weight", "weight_scale", "weight_min", "bias"):
        getattr(layer, name).data.copy_(tensors[name])
    method.process_weights_after_loading(layer)
    x = torch.randn(gguf_linear.DEQUANTIZE_ROWS_F32 + 3, 96, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ tensors["reference_weight"].double().T + tensors["bias"].double()
    assert rel(method.apply(layer, x, layer.bias), ref) < 1e-5
    assert rel(method.apply(layer, x[:3], layer.bias), ref[:3]) < TOL[torch.float32]


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q6_K", "Q4_K"])
def test_small_batch_gemm_is_the_bf16_matmul_of_the_expanded_weight(type_name):
    """ps_gguf_gemm (bf16 x, 4..191 rows): the weight rounded to bf16 times x, float32
    sums; odd row counts of x and W (tiles of 4 by 4 with ragged edges), 16- and 32-wide
    groups, a bias, each output dtype; float32 x is refused (-2) for the other paths."""
    kernels = native.load()
    if not kernels.gguf_gemm_available():
        pytest.skip("this CPU has no AVX512-BF16: the small-batch GEMM is not built")
    rng = np.random.default_rng(7)
    per_block = BLOCK_TYPES[type_name][0]
    n, k = 37, per_block * (3 if per_block == 32 else 2)
    raw = random_blocks(type_name, n, k, rng)
    packed = pack(*(torch.from_numpy(p) for p in decompose(raw, type_name, (n, k))))
    weight = dequantize_packed(packed).float().to(torch.bfloat16).double()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    for m in (1, 4, 7, 17, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        ref = x.double() @ weight.T + bias.double()
        for out_dtype, code in ((torch.float32, 0), (torch.bfloat16, 1), (torch.float16, 2)):
            y = torch.full((m, n + 3), float("nan"), dtype=out_dtype)  # row stride n + 3: only [:, :n] written
            rc = kernels.gguf_gemm(x.data_ptr(), k, 1, m, k, packed.qweight.data_ptr(), packed.bits, packed.group,
                                   packed.scales.data_ptr(), packed.mins.data_ptr(), n, bias.data_ptr(), y.data_ptr(),
                                   n + 3, code, 2)
            assert rc == 0
            assert y[:, n:].isnan().all()
            tol = 1e-5 if out_dtype == torch.float32 else 8e-3
            assert rel(y[:, :n], ref) < tol, (type_name, m, out_dtype, rel(y[:, :n], ref))
    xf = torch.randn(4, k)
    assert kernels.gguf_gemm(xf.data_ptr(), k, 0, 4, k, packed.qweight.data_ptr(), packed.bits, packed.group,
                             packed.scales.data_ptr(), packed.mins.data_ptr(), n, None, xf.data_ptr(), k, 0, 1) == -2


def test_the_layer_takes_the_small_batch_gemm_between_its_thresholds(monkeypatch):
    """bf16 x of GEMM_ROWS..DEQUANTIZE_ROWS - 1 rows goes through ps_gguf_gemm: exactly
    its result, which is within bf16 rounding of the expanded weight's matmul."""
    from torch import nn

    from portaserve.platforms.cpu import gguf_linear

    kernels = native.load()
    if not kernels.gguf_gemm_available():
        pytest.skip("this CPU has no AVX512-BF16")
    calls = []
    real = kernels.gguf_gemm
    monkeypatch.setattr(kernels, "gguf_gemm", lambda *a: calls.append(a[3]) or real(*a))
    method = gguf_linear.CpuGGUFMethod()
    method.platform_features = frozenset({"c_kernels"})
    layer = nn.Module()
    method.create_weights(layer, 96, 40, torch.bfloat16, False)
    tensors = gguf_linear.CpuGGUFMethod.conformance_weights(96, 40, torch.bfloat16, torch.Generator().manual_seed(0))
    for name in ("weight", "weight_scale", "weight_min"):
        getattr(layer, name).data.copy_(tensors[name])
    method.process_weights_after_loading(layer)
    for m in (gguf_linear.GEMM_ROWS - 1, gguf_linear.GEMM_ROWS, 33, gguf_linear.DEQUANTIZE_ROWS - 1,
              gguf_linear.DEQUANTIZE_ROWS):
        x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        ref = x.double() @ tensors["reference_weight"].double().T
        assert rel(method.apply(layer, x), ref) < TOL[torch.bfloat16]
    assert calls == [gguf_linear.GEMM_ROWS, 33, gguf_linear.DEQUANTIZE_ROWS - 1]
