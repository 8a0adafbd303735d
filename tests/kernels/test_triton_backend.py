"""TritonAttentionBackend on CPU through the Triton interpreter: the conformance kit's
attention scenarios (multi-step, NaN-poisoned cache, shuffled blocks, padding tokens
aimed at live slots, shared prefixes), split-K through the backend, its declared
capabilities, and the OpImpls of `kernels.ops`.

With ``PORTASERVE_TRITON_TEST_DEVICE=cuda`` (any torch device other than cpu) the kernels run
compiled on that device, TRITON_INTERPRET unset (ci/gpu_check.sh on a GPU machine); the
end-to-end test on the CPU platform is then skipped."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from portaserve.framework.interfaces import AttentionBatch, AttentionSpec
from portaserve.framework.interfaces.ops import OP_NAMES
from portaserve.framework.testing.attention_checks import default_cases, run_case
from portaserve.kernels._interpret import interpreter_env
from portaserve.kernels.ops import triton_ops

#: cpu: the interpreter (CI); another torch device: the compiled kernels there (a GPU check)
DEVICE = torch.device(os.environ.get("PORTASERVE_TRITON_TEST_DEVICE") or "cpu")
INTERPRET = DEVICE.type == "cpu"

with interpreter_env() if INTERPRET else contextlib.nullcontext():  # triton and the kernels are decorated (interpreted or compiled) on import
    pytest.importorskip("triton")
    from portaserve.kernels import activation, paged_attention, reshape_and_cache, rms_norm, rotary  # noqa: F401
    from portaserve.kernels import triton_backend
    from portaserve.kernels.triton_backend import TritonAttentionBackend, TritonAttentionMetadata


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    """TRITON_INTERPRET=1 while each test runs (triton reads it at launch too), and only then."""
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def _poisoned_output(monkeypatch):
    """Every attention output starts as NaN, so a row the kernels skip fails the check."""
    monkeypatch.setattr(triton_backend, "_new_output", lambda q: torch.full_like(q, float("nan")))


#: Scenario kinds run in the half-precision dtypes besides a corner of the mixed grid; the
#: interpreter is slow, and test_triton_kernels already covers windows and soft caps per dtype.
_HALF_KINDS = {
    torch.bfloat16: ("order-", "padding-", "decodes-", "shared-prefix-", "softcap-window-"),
    torch.float16: ("padding-", "decodes-"),
}


def _kit_cases():
    """The kit's grid, thinned for the interpreter (test_triton_kernels covers the whole
    kernel grid): in float32 every scenario, the mixed one at (d64, bs16) and (d128, bs32)
    for every head config; in bf16/fp16 two corners of the mixed grid (GQA 4 at d64/bs16,
    GQA 8 at d128/bs32) and `_HALF_KINDS`."""
    cases = []
    for dtype in DTYPES:
        for case in default_cases(TritonAttentionBackend, dtype):
            if case.name.startswith("mixed-") and ("-bs32-d64-" in case.name or "-bs16-d128-" in case.name):
                continue
            if dtype is not torch.float32:
                corner = case.name.endswith(("-bs16-d64-h8kv2", "-bs32-d128-h16kv2"))
                if not (corner or case.name.startswith(_HALF_KINDS[dtype])):
                    continue
            cases.append(case)
    return cases


KIT_CASES = _kit_cases()


@pytest.mark.grid(keep=2)
@pytest.mark.parametrize("case", KIT_CASES, ids=[c.name for c in KIT_CASES])
def test_conformance_kit(case):
    result = run_case(TritonAttentionBackend, case, DEVICE)
    assert result.skipped is None, result.skipped
    assert result.errors


class _AlwaysSplit(TritonAttentionBackend):
    """The same backend with each decode step's context cut into 4 splits of 16-key tiles
    (the kit's contexts are too short for the device heuristic to split them). Prefill
    steps stay unsplit: the interpreter is slow, and test_triton_kernels covers splits
    of batches with prefill chunks."""

    def build_metadata(self, batch):
        meta = super().build_metadata(batch)
        if batch.max_query_len > 1:
            return meta
        return dataclasses.replace(meta, work=dataclasses.replace(meta.work, num_splits=4, block_n=16))


SPLIT_CASES = [
    c for dtype in DTYPES for c in default_cases(TritonAttentionBackend, dtype)
    if c.name.startswith(("decodes-", "window5-", "shared-prefix-"))
]


@pytest.mark.grid(keep=1)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c.name for c in SPLIT_CASES])
def test_conformance_kit_split_k(case):
    result = run_case(_AlwaysSplit, case, DEVICE)
    assert result.skipped is None, result.skipped


def _spec(**kw) -> AttentionSpec:
    base = dict(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, dtype=torch.bfloat16)
    base.update(kw)
    return AttentionSpec(**base)


def test_declared_capabilities():
    cls = TritonAttentionBackend
    assert cls.name == "triton"
    assert cls.platforms is None and cls.runs_on("any-vendor")  # wherever "triton" is declared
    assert cls.required_features == {"triton"}
    assert cls.unsupported_reason(_spec(), 16) is None
    assert cls.unsupported_reason(_spec(head_size=80, sliding_window=128, logits_soft_cap=30.0), 64) is None
    assert cls.unsupported_reason(_spec(num_heads=32, num_kv_heads=2), 32) is None  # GQA 16
    assert "head size 48" in cls.unsupported_reason(_spec(head_size=48), 16)
    assert "block size 8" in cls.unsupported_reason(_spec(), 8)
    assert "GQA ratio 32" in cls.unsupported_reason(_spec(num_heads=32, num_kv_heads=1), 16)
    assert cls.unsupported_reason(_spec(causal=False), 16) is None  # encoders: torch SDPA per sequence
    assert cls.unsupported_reason(_spec(kv_cache_dtype="fp8"), 16) is None  # fp8 KV: quantized on write
    with pytest.raises(ValueError, match="block size 8"):
        cls(_spec(), 8, torch.device("cpu"))


def test_layout_metadata_and_work_split():
    backend = TritonAttentionBackend(_spec(dtype=torch.float32), 16, torch.device("cpu"))
    assert backend.kv_cache_shape(7) == (7, 2, 2, 16, 64)
    assert backend.kv_cache_bytes_per_block() == 2 * 2 * 16 * 64 * 4
    qsl = torch.tensor([0, 30, 31, 33], dtype=torch.int32)
    batch = AttentionBatch(
        query_start_loc=qsl,
        seq_lens=torch.tensor([30, 80, 9], dtype=torch.int32),
        block_table=torch.zeros(3, 5, dtype=torch.int32),
        slot_mapping=torch.arange(36, dtype=torch.int64),
        max_query_len=30,
        max_seq_len=80,
        block_size=16,
        num_actual_tokens=33,
    )
    meta = backend.build_metadata(batch)
    assert isinstance(meta, TritonAttentionMetadata) and meta.num_actual_tokens == 33
    assert meta.work.num_tokens == 33
    # work items: BLOCK_Q = 64 rows / 4 heads = 16 tokens -> seq 0 needs 2, the others 1 each
    assert meta.work.seq_idx.tolist() == [0, 0, 1, 2]
    assert meta.work.q_first.tolist() == [0, 16, 0, 0]
    with pytest.raises(ValueError, match="KV cache is required"):
        backend.forward(torch.zeros(1, 8, 64), torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), None, meta)


@pytest.mark.slow
def test_import_needs_no_triton():
    # The plan imports every backend class to read its capabilities, also where triton is absent.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from portaserve.kernels.triton_backend import TritonAttentionBackend\n"
        "from portaserve.kernels.ops import triton_ops\n"
        "assert TritonAttentionBackend.supported_block_sizes and len(triton_ops(frozenset({'cuda'}))) == 6\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_triton_ops():
    impls = triton_ops(frozenset({"cuda", "rocm"}))
    assert sorted(i.op for i in impls) == sorted(OP_NAMES)
    for impl in impls:
        assert impl.name == "triton"
        assert impl.platforms == {"cuda", "rocm"}
        assert impl.required_features == {"triton"}
        fn = impl.load()
        assert callable(fn) and fn.__name__ == impl.op
    assert {i.platforms for i in triton_ops(frozenset({"xpu"}))} == {frozenset({"xpu"})}
    # the loaded op runs (through the interpreter here) with the documented signature
    ops = {i.op: i.load() for i in impls}
    x = torch.randn(3, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(ops["rms_norm"](x, w, 1e-6), ref, atol=1e-5)
    out, residual = ops["fused_add_rms_norm"](x, x, w, 1e-6)
    assert torch.allclose(residual, 2 * x) and torch.allclose(out, ref, atol=1e-5)
    # structured outputs' mask: the kernel against the torch reference, a vocabulary that
    # is not a multiple of the block nor of 32
    from portaserve.framework.op_references import apply_token_bitmask, bitmask_samples

    for logits, bitmask in bitmask_samples(DEVICE, torch.float32, torch.Generator().manual_seed(0)):
        expected = apply_token_bitmask(logits, bitmask)
        assert torch.equal(ops["apply_token_bitmask"](logits.clone(), bitmask), expected)
    # LoRA: the shrink / expand kernels against the torch reference (tokens without an
    # adapter, ranks that are not a power of two, outputs that are not a multiple of the block)
    from portaserve.framework.op_references import lora_linear, lora_samples

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for args in lora_samples(DEVICE, dtype, torch.Generator().manual_seed(1)):
            expected = lora_linear(*[a.clone() for a in args]).float()
            got = ops["lora_linear"](*[a.clone() for a in args]).float()
            assert (got - expected).norm() <= tol * expected.norm(), dtype
    y, x, a, b, _ = lora_samples(DEVICE, torch.float32, torch.Generator().manual_seed(2))[1]
    a = torch.cat([a, a[:, :3]], dim=1)  # rank 19
    b = torch.cat([b, b[:, :3]], dim=1)
    slots = torch.tensor([0, -1, 2, 1, 1, -1, 0], device=DEVICE)
    assert torch.allclose(ops["lora_linear"](y.clone(), x, a, b, slots), lora_linear(y.clone(), x, a, b, slots), atol=1e-5)


# ----- end to end ---------------------------------------------------------------------------


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """The Triton backend selectable on the CPU platform, as under TRITON_INTERPRET=1.

    Adds only what the installed plugins do not provide yet (the "triton" registration and
    the CPU platform's "triton" feature), so once they do, this tests the real wiring.
    """
    import dataclasses as dc

    from portaserve.framework.plugins import Component, get_registry
    from portaserve.platforms.cpu.platform import CpuPlatform

    registry = get_registry()
    backends = registry.components["attention_backends"]
    if "triton" not in backends:
        monkeypatch.setitem(backends, "triton", Component("triton", "attention_backends", "test", "portaserve.kernels.triton_backend:TritonAttentionBackend"))
    original = CpuPlatform.capabilities
    if "triton" not in original(CpuPlatform(CpuPlatform.probe())).features:
        monkeypatch.setattr(CpuPlatform, "capabilities", lambda self: dc.replace(original(self), features=original(self).features | {"triton"}))
    return registry


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRET, reason="the CPU platform under the interpreter (on a GPU, ci/gpu_check.sh's parity step)")
def test_engine_greedy_matches_cpu_backend(triton_on_cpu, tmp_path, monkeypatch):
    """The tiny Qwen2 checkpoint (sliding-window and full layers, head size 16) generates the
    same greedy tokens with the Triton backend and fused ops as with cpu_paged and torch ops."""
    from portaserve import LLM
    from portaserve.framework.engine.params import SamplingParams

    registry = triton_on_cpu
    registry.get("checkpoint_writers", "Qwen2ForCausalLM")(str(tmp_path), "tiny", 0)
    prompts = ["Hello world, this is", "The quick brown fox jumps over the lazy dog and then", "a"]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    tokens = {}
    for backend in ("cpu_paged", "triton"):
        if backend == "triton":  # the Triton fused ops too (GPU platforms register them)
            cpu_ops = [("test", dataclasses.replace(op, priority=100)) for op in triton_ops(frozenset({"cpu"}))]
            monkeypatch.setattr(registry, "custom_ops", list(registry.custom_ops) + cpu_ops)
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", attention_backend=backend, max_model_len=128)
        assert {choice.name for _t, choice in llm.plan.attention} == {backend}
        ops = {op: impl for op, impl in llm.plan.custom_ops if op in OP_NAMES}  # plugins may declare more
        assert all(impl == "triton" for impl in ops.values()) if backend == "triton" else "triton" not in ops.values()
        assert set(ops) == set(OP_NAMES), ops
        tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(t) == 8 for t in tokens["triton"])
    assert tokens["triton"] == tokens["cpu_paged"]
