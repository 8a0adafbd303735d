"""The CPU platform's C kernels (platforms/cpu/*.c): fused ops and decode attention against
float64 references, built twice where possible — for this CPU (`-march=native`, the
AVX-512 paths here) and portable (`-march=x86-64-v3`, the plain-C paths CPUs without
AVX-512 take) — plus the torch fallback when the library cannot be built."""

from __future__ import annotations

import math
import platform

import pytest
import torch
import torch.nn.functional as F

from portaserve.framework.interfaces import AttentionSpec
from portaserve.framework.interfaces.ops import OP_NAMES
from portaserve.framework.testing.attention_checks import AttentionCase, default_cases, run_case
from portaserve.platforms.cpu import fused_ops, native
from portaserve.platforms.cpu.attention import CpuPagedAttentionBackend

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# relative error vs float64 allowed per dtype: a few roundings to the dtype
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _variants():
    if not native.enabled():
        return []
    names = ["native"]
    if platform.machine() in ("x86_64", "AMD64"):
        names.append("x86-64-v3")
    return names


@pytest.fixture(scope="module", params=_variants())
def kernels(request):
    return native.build(request.param)


@pytest.fixture
def use(kernels, monkeypatch):
    """Route the fused ops through this variant of the library."""
    monkeypatch.setattr(native, "load", lambda: kernels)
    return kernels


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def rms_ref(x, w, eps):
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


SHAPES = [(1, 896), (7, 64), (300, 896), (5, 100), (3, 2, 40)]


@pytest.mark.grid(keep=3)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm(use, dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    res = torch.randn(shape, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    out = fused_ops.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel(out, rms_ref(x, w, 1e-6)) < TOL[dtype]
    x_before, res_before = x.clone(), res.clone()
    out, new_res = fused_ops.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs untouched
    assert torch.equal(new_res, x + res)  # the residual rounds like torch's add
    assert rel(out, rms_ref(new_res, w, 1e-6)) < TOL[dtype]


def test_rms_norm_matches_the_layers_torch_code_in_bf16(use):
    """Same float32 math and the same two roundings: equal but for the last bit where the
    float32 sums differ in order (a 1-ulp difference before the weight, 2 after)."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 896, generator=gen) * 2).bfloat16()
    w = (1 + 0.1 * torch.randn(896, generator=gen)).bfloat16()
    ref = fused_ops._torch_rms_norm(x, w, 1e-6)
    out = fused_ops.rms_norm(x, w, 1e-6)
    two_ulps = (ref.float().abs() * 2**-6).clamp(min=1e-30)
    assert ((out.float() - ref.float()).abs() <= two_ulps).all()
    assert (out == ref).float().mean() > 0.99


def test_rms_norm_strided_rows(use):
    base = torch.randn(10, 2 * 96).bfloat16()
    x = base[:, :96]  # rows 192 apart
    w = torch.ones(96).bfloat16()
    assert rel(fused_ops.rms_norm(x, w, 1e-5), rms_ref(x, w, 1e-5)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2 * 4864), (9, 2 * 40), (300, 2 * 512), (2, 3, 2 * 24)], ids=str)
def test_silu_and_mul(use, dtype, shape):
    gen = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(shape, generator=gen) * 4).to(dtype)
    d = shape[-1] // 2
    xd = x.double()
    ref = F.silu(xd[..., :d]) * xd[..., d:]
    out = fused_ops.silu_and_mul(x)
    assert out.shape == (*shape[:-1], d) and out.dtype == dtype
    assert rel(out, ref) < TOL[dtype]
    # a strided view of a wider tensor (gate_up as a slice)
    wide = torch.cat([x, x], dim=-1)[..., : 2 * d]
    assert rel(fused_ops.silu_and_mul(wide), ref) < TOL[dtype]


def test_silu_extremes(use):
    x = torch.tensor([[-200.0, -50.0, 0.0, 50.0, 200.0, 1.0] + [0.5] * 6], dtype=torch.float32)
    x = torch.cat([x, torch.ones_like(x)], dim=-1)
    out = fused_ops.silu_and_mul(x)
    ref = F.silu(x[..., :12].double())
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-30)


def rotary_ref(positions, x, table, is_neox):
    rot_dim = table.shape[-1]
    half = rot_dim // 2
    cs = table.double()[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    xd = x.double()
    rot, rest = xd[..., :rot_dim], xd[..., rot_dim:]
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim,tokens", [(64, 64, 5), (128, 64, 3), (64, 64, 400)])
def test_rotary(use, dtype, is_neox, head_size, rot_dim, tokens):
    gen = torch.Generator().manual_seed(head_size + tokens)
    qkv = torch.randn(tokens, (6 + 2 * 2) * head_size, generator=gen).to(dtype)
    q = qkv[:, : 6 * head_size].view(tokens, 6, head_size)  # strided views, as the model passes them
    k = qkv[:, 6 * head_size : 8 * head_size].view(tokens, 2, head_size)
    angles = torch.arange(1000.0)[:, None] * torch.rand(rot_dim // 2, generator=gen)
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.randint(0, 1000, (tokens,), generator=gen)
    q_before = q.clone()
    q_out, k_out = fused_ops.rotary_embedding(positions, q, k, table, is_neox)
    assert torch.equal(q, q_before)
    assert rel(q_out, rotary_ref(positions, q, table, is_neox)) < TOL[dtype]
    assert rel(k_out, rotary_ref(positions, k, table, is_neox)) < TOL[dtype]


def test_ops_fall_back_to_torch_without_the_library(monkeypatch):
    monkeypatch.setattr(native, "load", lambda: None)
    x = torch.randn(4, 2 * 32).bfloat16()
    w = torch.ones(64).bfloat16()
    assert rel(fused_ops.rms_norm(x, w, 1e-6), rms_ref(x, w, 1e-6)) < TOL[torch.bfloat16]
    assert rel(fused_ops.silu_and_mul(x), F.silu(x[:, :32].double()) * x[:, 32:].double()) < TOL[torch.bfloat16]
    table = torch.cat([torch.ones(10, 8), torch.zeros(10, 8)], dim=-1)  # angle 0: identity
    q = torch.randn(3, 2, 16).bfloat16()
    q_out, _ = fused_ops.rotary_embedding(torch.tensor([1, 2, 3]), q, q, table, True)
    assert torch.equal(q_out, q)


# ----- decode attention through each variant ---------------------------------------------------------


def AttentionSpecFor(dtype):  # noqa: N802 - reads like the class it builds
    return AttentionSpec(14, 2, 64, 0.125, dtype)


def _backend_on(kernels):
    class Backend(CpuPagedAttentionBackend):
        native_part_len = 24  # long contexts span several parts

        def __init__(self, spec, block_size, device):
            super().__init__(spec, block_size, device)
            if self._native is not None:
                self._native = kernels

    return Backend


def _decode_cases():
    steps = ((70, 45, 1, 130), (1, 1, 1, 1), (1, 1, 1, 1))
    for dtype in DTYPES:
        d = str(dtype).removeprefix("torch.")
        for hs in (64, 128, 80):
            for h, hkv in ((14, 2), (4, 1)):
                yield AttentionCase(f"{d}-d{hs}-h{h}kv{hkv}", h, hkv, hs, 16, dtype, steps, seed=hs)
        yield AttentionCase(f"{d}-window-softcap", 8, 2, 64, 8, dtype, steps, sliding_window=33, logits_soft_cap=4.0)


@pytest.mark.grid(keep=3)
@pytest.mark.parametrize("case", list(_decode_cases()), ids=lambda c: c.name)
def test_decode_attention(kernels, case):
    result = run_case(_backend_on(kernels), case, "cpu")
    assert result.skipped is None, result.skipped


@pytest.mark.slow
@pytest.mark.parametrize("march", [m for m in _variants() if m != "native"] or [None])
def test_conformance_grid_on_the_portable_build(march):
    # The kit's grid (bf16) on the portable build. The `-march=native` build is the one the
    # backend loads: test_cpu_attention.py runs this grid on it (test_against_reference) and
    # its split contexts on a wider one (test_native_split_contexts_against_reference).
    if march is None:
        pytest.skip("no portable build on this machine (no C compiler, or not x86-64)")
    backend = _backend_on(native.build(march))
    results = [run_case(backend, case, "cpu") for case in default_cases(CpuPagedAttentionBackend, torch.bfloat16)]
    ran = [r.name for r in results if r.skipped is None]
    assert ran, f"every case skipped: {[r.skipped for r in results]}"


def test_kernels_are_cached_per_source_and_cpu(kernels):
    again = native.build(kernels.march)
    assert again.path == kernels.path and kernels.path.exists()
    assert math.isfinite(kernels.workspace_floats(7, 64, 512))
    for h in (1, 64, 896, 4097):
        assert fused_ops.fused_workspace_floats(h) == kernels.fused_workspace_floats(h)


def _close_in_bf16(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal but for rare last-bit differences (float32 sums or exp in another order)."""
    assert out.dtype == ref.dtype == torch.bfloat16 and out.shape == ref.shape
    two_ulps = (ref.float().abs() * 2**-6).clamp(min=1e-30)
    assert ((out.float() - ref.float()).abs() <= two_ulps).all()
    assert (out == ref).float().mean() > 0.99


def test_silu_and_rotary_match_the_torch_references_in_bf16(use):
    """The C ops round where torch rounds, so outputs do not depend on the library."""
    from portaserve.framework import op_references

    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(37, 2 * 608, generator=gen) * 3).bfloat16()
    gate, up = x.chunk(2, dim=-1)
    _close_in_bf16(fused_ops.silu_and_mul(x), F.silu(gate) * up)
    _close_in_bf16(fused_ops.silu_and_mul(x), op_references.silu_and_mul(x))
    angles = torch.arange(500.0)[:, None] * (10000.0 ** (-torch.arange(32.0) / 32))
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    q = torch.randn(37, 14, 64, generator=gen).bfloat16()
    k = torch.randn(37, 2, 64, generator=gen).bfloat16()
    positions = torch.randint(0, 500, (37,), generator=gen)
    for is_neox in (True, False):
        q_ref, k_ref = op_references.rotary_embedding(positions, q.clone(), k.clone(), table, is_neox)
        q_out, k_out = fused_ops.rotary_embedding(positions, q, k, table, is_neox)
        _close_in_bf16(q_out, q_ref)
        _close_in_bf16(k_out, k_ref)


# ----- what the plan binds ---------------------------------------------------------------------------


def _plan(hf_config, **kw):
    from portaserve.framework.config import EngineConfig
    from portaserve.framework.plan import resolve_plan
    from portaserve.framework.plugins import get_registry
    from portaserve.framework.selection import choose_platform

    registry = get_registry()
    return resolve_plan(EngineConfig.create(device="cpu", **kw), registry, choose_platform(registry, "cpu"), hf_config)


C_OPS = (("apply_token_bitmask", "cpu_c"), ("fused_add_rms_norm", "cpu_c"), ("lora_linear", "cpu_c"),
         ("rms_norm", "cpu_c"), ("rotary_embedding", "cpu_c"), ("silu_and_mul", "cpu_c"))
REFERENCES = tuple((op, "reference") for op, _impl in C_OPS)


def builtin_ops(plan):
    """The plan's bindings of portaserve's own ops (installed plugins may declare more)."""
    return tuple((op, impl) for op, impl in plan.custom_ops if op in OP_NAMES)


def test_plan_binds_the_c_ops_where_they_build(plugin_env, engine_tiny_config):
    plan = _plan(engine_tiny_config)
    if not native.enabled():
        pytest.skip("no C compiler")
    assert "c_kernels" in plan.platform_features
    assert builtin_ops(plan) == C_OPS
    assert "rms_norm=cpu_c" in str(plan)


def test_plan_leaves_the_c_ops_out_when_compiling_or_disabled(plugin_env, engine_tiny_config):
    # torch.compile cannot trace a ctypes call: inductor fuses the torch references instead
    assert builtin_ops(_plan(engine_tiny_config, compilation_mode="max")) == REFERENCES
    plugin_env.setenv("PORTASERVE_CPU_NATIVE", "0")
    plan = _plan(engine_tiny_config)
    assert builtin_ops(plan) == REFERENCES and "c_kernels" not in plan.platform_features


# ----- building and loading ------------------------------------------------------------------------


@pytest.fixture
def fresh_loader(monkeypatch):
    """native.load() as in a new process (restored afterwards)."""
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_reason", None)
    return monkeypatch


def test_no_compiler_means_torch_code_with_a_reason(fresh_loader, engine_tiny_config, plugin_env):
    fresh_loader.setenv("CC", "/nonexistent/cc")
    assert native.compiler() is None and not native.enabled()
    assert native.load() is None
    assert "no C compiler" in native.unavailable_reason()
    backend = CpuPagedAttentionBackend(AttentionSpecFor(torch.bfloat16), 16, torch.device("cpu"))
    assert backend._native is None  # decodes through SDPA
    assert builtin_ops(_plan(engine_tiny_config)) == REFERENCES


def test_disabled_by_the_environment(fresh_loader):
    fresh_loader.setenv("PORTASERVE_CPU_NATIVE", "0")
    assert native.load() is None and native.unavailable_reason() == "PORTASERVE_CPU_NATIVE=0"


def test_a_failed_build_is_reported_not_raised(fresh_loader, tmp_path):
    if native.compiler() is None:
        pytest.skip("no C compiler")
    fresh_loader.setenv("PORTASERVE_CACHE_DIR", str(tmp_path))
    fresh_loader.setattr(native, "FLAGS", native.FLAGS + ("-include", "/nonexistent/header.h"))
    assert native.load() is None
    assert "building the CPU kernels failed" in native.unavailable_reason()


@pytest.mark.slow
def test_a_read_only_cache_folder_builds_in_the_temporary_folder(fresh_loader, tmp_path):
    if native.compiler() is None:
        pytest.skip("no C compiler")
    fresh_loader.setenv("PORTASERVE_CACHE_DIR", str(tmp_path / "cache"))
    real_build = native._build

    def build(cc, march, target):
        if str(target).startswith(str(tmp_path)):
            raise PermissionError(13, "read-only", str(target))
        real_build(cc, march, target)

    fresh_loader.setattr(native, "_build", build)
    kernels = native.load()
    assert kernels is not None and not str(kernels.path).startswith(str(tmp_path))


def test_lora_c_kernel_and_grouped_path_match_the_reference():
    """lora_linear on the CPU: the C kernel (few tokens) and the grouped matmuls (more),
    against the torch reference: tokens of one adapter not adjacent, tokens without one,
    a rank that is no multiple of the vector width, outputs that are not a multiple of 64."""
    from portaserve.framework.op_references import lora_linear as reference
    from portaserve.platforms.cpu import fused_ops

    if native.load() is None:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(3)
    for tokens in (1, 9, 64, 100):  # 100: past LORA_C_MAX_TOKENS, the grouped path
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
            y = torch.randn(tokens, 200, generator=gen).to(dtype)
            x = torch.randn(tokens, 72, generator=gen).to(dtype)
            a = (0.1 * torch.randn(3, 19, 72, generator=gen)).to(dtype)
            b = (0.1 * torch.randn(3, 19, 200, generator=gen)).to(dtype)
            slots = torch.randint(-1, 3, (tokens,), generator=gen)
            expected = reference(y.clone(), x, a, b, slots).float()
            got = fused_ops.lora_linear(y.clone(), x, a, b, slots).float()
            assert (got - expected).norm() <= tol * expected.norm(), (tokens, dtype)
    assert fused_ops.LORA_C_MAX_TOKENS == 64
