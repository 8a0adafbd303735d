"""The Triton GGUF matmul (kernels/gguf_matmul.py) against `gguf_layout.reference_matmul`
and against `gguf.quants.dequantize` of real GGUF blocks followed by a float64 matmul, on
CPU through the Triton interpreter (outputs NaN-poisoned so an unwritten element shows);
and the "gguf" QuantMethod running through it in a layer where the platform declares
"triton".

With ``PORTASERVE_TRITON_TEST_DEVICE=cuda`` (as test_triton_kernels.py) the same tests run
the compiled kernel on that device instead, with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch

from portaserve.kernels._interpret import interpreter_env

#: cpu: the interpreter (CI); another torch device: the compiled kernel there (a GPU check)
DEVICE = torch.device(os.environ.get("PORTASERVE_TRITON_TEST_DEVICE") or "cpu")
INTERPRET = DEVICE.type == "cpu"

with interpreter_env() if INTERPRET else contextlib.nullcontext():
    pytest.importorskip("triton")
    from portaserve.kernels import gguf_matmul as gguf_matmul_module
    from portaserve.kernels.gguf_matmul import gguf_matmul, gguf_matmul_triton

from gguf import GGMLQuantizationType, quants  # noqa: E402

from portaserve.framework.gguf.blocks import BLOCK_TYPES, decompose, random_blocks  # noqa: E402
from portaserve.framework.quantization.gguf import GGUFMethod  # noqa: E402
from portaserve.framework.quantization.gguf_layout import PackedGGUF, pack, reference_matmul  # noqa: E402
from portaserve.framework.testing.quant_checks import check_quant_method  # noqa: E402

#: against reference_matmul (the same packed weight in float32). bf16: the weight tile is
#: rounded to bf16 for tl.dot, and the output too (the interpreter's casts truncate, which
#: doubles both: ~6e-3 there)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
#: against gguf.quants.dequantize: the packed layout keeps scales and mins in float16, and
#: the K-types' products (d * 6-bit sub-scale) round there (~2e-4 relative)
GGUF_TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    """TRITON_INTERPRET=1 while each test runs (triton reads it at launch too); on a GPU,
    TRITON_INTERPRET unset."""
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(autouse=True)
def _poisoned_output(monkeypatch):
    real_empty = torch.empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        if out.is_floating_point():
            out.fill_(float("nan"))
        return out

    monkeypatch.setattr(gguf_matmul_module.torch, "empty", empty)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def on_device(packed: PackedGGUF) -> PackedGGUF:
    return PackedGGUF(packed.qweight.to(DEVICE), packed.scales.to(DEVICE), packed.mins.to(DEVICE), packed.bits, packed.group)


def random_packed(bits: int, group: int, n: int, k: int, gen: torch.Generator) -> PackedGGUF:
    """Codes over the whole range, scales and (negative) mins per `group` weights."""
    top = 16 if bits == 4 else 256
    codes = torch.randint(0, top, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.002).repeat_interleave(group // 16, dim=1)
    mins = -scales * top / 2 * torch.rand(n, k // group, generator=gen).repeat_interleave(group // 16, dim=1)
    packed = pack(codes, scales, mins)
    assert (packed.bits, packed.group) == (bits, group)
    return packed


# M in 1, 3 (the 16-row tiles), 17 (32-row tiles), 70 (64 x 128 tiles, two M tiles); N never a
# multiple of the tile width; K 32 (under one K tile), 96 and 160 (a masked last tile)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 33, 32), (3, 70, 96), (17, 45, 160), (70, 130, 96)])
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 16), (8, 32), (8, 16)])
@pytest.mark.grid(keep=4)
def test_packings_and_shapes(bits, group, m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k + bits + group)
    packed = random_packed(bits, group, n, k, gen)
    x = torch.randn(m, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    dev = on_device(packed)
    for dtype in DTYPES:
        xd, bd = x.to(dtype), None if b is None else b.to(dtype)
        y = gguf_matmul(xd.to(DEVICE), dev, None if bd is None else bd.to(DEVICE))
        assert y.dtype == dtype and y.shape == (m, n)
        err = rel(y, reference_matmul(xd, packed, bd))
        assert err < TOL[dtype], (dtype, err)


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
@pytest.mark.grid(keep=4)  # the fast tier: Q4_0, Q4_K, Q5_K, Q8_0
def test_every_type_matches_gguf_dequantize_then_matmul(type_name):
    rng = np.random.default_rng(3)
    per_block = BLOCK_TYPES[type_name][0]
    n, k = 37, per_block * (3 if per_block == 32 else 2)  # odd row count; K not a multiple of 64 for 32-blocks
    raw = random_blocks(type_name, n, k, rng)
    weight = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(n, k).astype(np.float64))
    packed = pack(*(torch.from_numpy(p) for p in decompose(raw, type_name, (n, k))))
    assert packed.bits == (4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8)
    assert packed.group == (16 if type_name == "Q6_K" else 32)
    dev = on_device(packed)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    for m in (1, 5):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m), dtype=torch.float64)
        for dtype in DTYPES:
            xd, bd = x.to(dtype), bias.to(dtype)
            out = gguf_matmul(xd.to(DEVICE), dev, bd.to(DEVICE))
            assert out.dtype == dtype and out.shape == (m, n)
            ref = xd.double() @ weight.T + bd.double()
            assert rel(out, ref) < GGUF_TOL[dtype], (type_name, m, dtype, rel(out, ref))
            assert rel(out, reference_matmul(xd, packed, bd)) < TOL[dtype], (type_name, m, dtype)


def test_strided_activations_and_empty():
    gen = torch.Generator().manual_seed(0)
    packed = random_packed(4, 32, 40, 64, gen)
    wide = torch.randn(4, 128, generator=gen)
    x = wide[:, :64]  # row stride 128 (the model passes slices)
    assert rel(gguf_matmul(x.to(DEVICE), on_device(packed)), reference_matmul(x, packed)) < TOL[torch.float32]
    assert gguf_matmul(torch.randn(0, 64, device=DEVICE), on_device(packed)).shape == (0, 40)


def test_errors():
    gen = torch.Generator().manual_seed(0)
    p = random_packed(4, 32, 16, 64, gen)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        gguf_matmul_triton(x, p.qweight, p.scales, p.mins, 5, 32)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        gguf_matmul_triton(torch.randn(2, 96), p.qweight, p.scales, p.mins, 4, 32)
    with pytest.raises(ValueError, match="scales and mins"):
        gguf_matmul_triton(x, p.qweight, p.scales[:, :1], p.mins, 4, 32)
    with pytest.raises(ValueError, match="uint8"):
        gguf_matmul_triton(x, p.qweight.to(torch.int16), p.scales, p.mins, 4, 32)
    with pytest.raises(ValueError, match="bias"):
        gguf_matmul_triton(x, p.qweight, p.scales, p.mins, 4, 32, torch.zeros(15))


def test_custom_op_matches_launcher():
    gen = torch.Generator().manual_seed(0)
    p = on_device(random_packed(8, 16, 24, 64, gen))
    x = torch.randn(3, 64, generator=gen).to(DEVICE, torch.bfloat16)
    torch.testing.assert_close(
        torch.ops.portaserve.gguf_matmul(x, p.qweight, p.scales, p.mins, p.bits, p.group, None),
        gguf_matmul_triton(x, p.qweight, p.scales, p.mins, p.bits, p.group),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.grid(keep=1)
def test_gguf_method_runs_the_triton_kernel_in_a_layer(monkeypatch, dtype):
    """The conformance kit's layer check with "triton" declared: `_prepare` imports this
    kernel (counted through a spy on the module attribute it imports) and every apply uses it."""
    calls = []

    def spy(x, packed, bias=None):
        calls.append(tuple(x.shape))
        return gguf_matmul(x, packed, bias)

    monkeypatch.setattr(gguf_matmul_module, "gguf_matmul", spy)
    assert check_quant_method(GGUFMethod, DEVICE, dtype, frozenset({"triton"})) is None
    assert len(calls) == 6  # two layers x three input shapes, none through the torch path

    method = GGUFMethod()
    method.platform_features = frozenset({"triton"})
    method.prefix = "layer"
    layer = torch.nn.Module()
    method.create_weights(layer, 64, 16, dtype, bias=False)
    for name, value in GGUFMethod.conformance_weights(64, 16, dtype, torch.Generator().manual_seed(0)).items():
        if hasattr(layer, name) and getattr(layer, name) is not None:
            getattr(layer, name).data.copy_(value)
    method.process_weights_after_loading(layer)
    assert method._matmul is spy
