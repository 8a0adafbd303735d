"""The Triton int8 weight-only kernel against its float64 reference, on CPU through the
Triton interpreter (fresh random inputs; the output is NaN-poisoned so an unwritten
element shows)."""

from __future__ import annotations

import pytest
import torch

from portaserve.kernels._interpret import interpreter_env

with interpreter_env():
    pytest.importorskip("triton")
    from portaserve.kernels import int8_matmul
    from portaserve.kernels.int8_matmul import (
        MAX_SPLIT_K,
        choose_split_k,
        int8_weight_only_mm_ref,
        int8_weight_only_mm_triton,
    )

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _poisoned_output(monkeypatch):
    real_empty = torch.empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        if out.is_floating_point():
            out.fill_(float("nan"))
        return out

    monkeypatch.setattr(int8_matmul.torch, "empty", empty)


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m,k,n,split_k",
    [(1, 64, 48, None), (3, 200, 70, 2), (20, 96, 40, 1), (70, 64, 130, None), (5, 512, 33, 4), (2, 40, 16, 8)],
)
@pytest.mark.grid(keep=3)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_weight_only_mm(dtype, m, k, n, split_k, bias):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    y = int8_weight_only_mm_triton(x, w, scale, b, split_k=split_k)
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel(y, int8_weight_only_mm_ref(x, w, scale, b)) < TOL[dtype]


def test_strided_activations():
    x = torch.randn(4, 128)[:, :64]  # row stride 128
    w = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    scale = torch.rand(32) * 0.01
    assert rel(int8_weight_only_mm_triton(x, w, scale), int8_weight_only_mm_ref(x, w, scale)) < 1e-5


def test_empty_and_errors():
    w = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    assert int8_weight_only_mm_triton(torch.randn(0, 64), w, torch.ones(32)).shape == (0, 32)
    with pytest.raises(ValueError, match="int8"):
        int8_weight_only_mm_triton(torch.randn(2, 64), w.float(), torch.ones(32))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        int8_weight_only_mm_triton(torch.randn(2, 63), w, torch.ones(32))
    with pytest.raises(ValueError, match="power of two"):
        int8_weight_only_mm_triton(torch.randn(2, 64), w, torch.ones(32), split_k=3)


def test_choose_split_k():
    # enough tiles already: no split; few tiles and a long K: split up to MAX_SPLIT_K (a power of two)
    assert choose_split_k(num_programs=300, k=4096, block_k=128, target_programs=264) == 1
    assert choose_split_k(num_programs=28, k=4864, block_k=128, target_programs=264) == MAX_SPLIT_K
    assert choose_split_k(num_programs=100, k=4096, block_k=128, target_programs=264) == 2
    # a short K cannot give every split two tiles
    assert choose_split_k(num_programs=1, k=256, block_k=128, target_programs=264) == 1
    for p in range(1, 64):
        s = choose_split_k(p, 8192, 64, 200)
        assert s & (s - 1) == 0 and 1 <= s <= MAX_SPLIT_K


def test_custom_op_matches_launcher():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.randint(-127, 128, (48, 64), dtype=torch.int8)
    scale = torch.rand(48) * 0.01
    torch.testing.assert_close(torch.ops.portaserve.int8_weight_only_mm(x, w, scale, None), int8_weight_only_mm_triton(x, w, scale))
