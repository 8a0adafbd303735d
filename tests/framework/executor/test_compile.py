"""Graph compilation: the plan's choice, torch.compile on the CPU (greedy output equal to
eager, the on-disk cache reused), and the decode-graph path's bucketing, padding and
capture/replay plumbing (exercised on the CPU with a stand-in `GraphCapture` that replays
by re-running the captured function on its static buffers)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from portaserve.framework.config import EngineConfig
from portaserve.framework.errors import UnsupportedError
from portaserve.framework.executor import compile as compile_mod
from portaserve.framework.executor.compile import EagerForward, TorchCompileForward
from portaserve.framework.executor.decode_graphs import (
    DecodeGraphForward,
    bucket_for,
    copy_tensors,
    decode_buckets,
    is_pure_decode,
    pad_decode_batch,
    same_structure,
)
from portaserve.framework.interfaces import AttentionBatch, PlatformCapabilities
from portaserve.framework.interfaces.graph_capture import GraphCapture
from portaserve.framework.plan import _choose_compilation

PROMPTS = [list(range(1000, 1012)), list(range(5000, 5005)), [42, 43, 44, 45, 46, 47, 48]]


def _runner(llm):
    return llm.llm_engine.core.executor.worker.runner


def _greedy(llm, max_tokens=(8, 5, 3)):
    from portaserve import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# ----- the plan -----------------------------------------------------------------------------


def _platform(compile_backends, default="none", name="fake"):
    caps = PlatformCapabilities(dtypes=frozenset({torch.float32}), kv_cache_dtypes=frozenset({"auto"}),
                                compile_backends=compile_backends, default_compilation_mode=default)
    return SimpleNamespace(name=name, capabilities=lambda: caps)


def test_plan_compilation_choice():
    gpu = _platform({"default": "cudagraphs", "max": "inductor"}, default="default", name="gpu")
    choice, backend = _choose_compilation(EngineConfig.create(), gpu)
    assert (choice.name, backend) == ("default", "cudagraphs") and "measured default" in choice.reason
    choice, backend = _choose_compilation(EngineConfig.create(compilation_mode="max"), gpu)
    assert (choice.name, backend) == ("max", "inductor") and "--compilation-mode max" in choice.reason
    choice, backend = _choose_compilation(EngineConfig.create(enforce_eager=True), gpu)
    assert (choice.name, backend) == ("none", None) and "--enforce-eager" in choice.reason
    tpu = _platform({"default": "openxla"}, name="tpu")
    with pytest.raises(UnsupportedError, match="'max' is not supported on platform tpu; supported: none, default"):
        _choose_compilation(EngineConfig.create(compilation_mode="max"), tpu)


def test_cpu_platform_declares_graphs_and_inductor(monkeypatch):
    """With the C kernels, "default" (the CPU's default mode) replays decode graphs of
    recorded kernel calls; "max" is inductor. Without them: inductor, eager by default."""
    from portaserve.platforms.cpu.platform import CPU_GRAPHS, CpuPlatform

    platform = CpuPlatform(CpuPlatform.probe())
    caps = platform.capabilities()
    assert dict(caps.compile_backends) == {"default": CPU_GRAPHS, "max": "inductor"}
    assert caps.default_compilation_mode == "default" and caps.graph_backends == {CPU_GRAPHS}
    assert platform.graph_capture(CPU_GRAPHS) is not None and platform.graph_capture("inductor") is None
    monkeypatch.setenv("PORTASERVE_CPU_NATIVE", "0")
    caps = platform.capabilities()
    assert dict(caps.compile_backends) == {"default": "inductor", "max": "inductor"}
    assert caps.default_compilation_mode == "none"


def test_build_forward_by_backend():
    model = torch.nn.Linear(2, 2)
    plan = lambda mode, backend: SimpleNamespace(compilation=SimpleNamespace(name=mode), compile_backend=backend, block_size=16)  # noqa: E731
    kw = dict(max_num_seqs=8, max_model_len=64)
    graphs = ReplayByRerun()
    assert type(compile_mod.build_forward(model, plan("none", None), **kw)) is EagerForward
    # a backend the platform records graphs for (its graph_capture hook answered)
    forward = compile_mod.build_forward(model, plan("default", "devicegraphs"), graph_capture=graphs, **kw)
    assert isinstance(forward, DecodeGraphForward) and forward.graphs is graphs
    # an encoder has no decode steps: eager
    assert type(compile_mod.build_forward(model, plan("default", "devicegraphs"), graph_capture=graphs, is_pooling=True, **kw)) is EagerForward


def test_graph_capture_is_the_platforms_hook():
    """Which backend name means "replay recorded graphs" is the platform's to say: the
    base Platform records none, and the CUDA platform records for "cudagraphs" only."""
    from portaserve.framework.interfaces import DeviceInfo
    from portaserve.platforms.cpu.platform import CpuPlatform
    from portaserve.platforms.cuda.graphs import TorchCudaGraphs
    from portaserve.platforms.cuda.platform import CudaPlatform

    cpu = CpuPlatform(CpuPlatform.probe())
    assert cpu.graph_capture("inductor") is None
    cuda = CudaPlatform(DeviceInfo("cuda", "test GPU", 1, 2**30, 100, "test"))
    assert isinstance(cuda.graph_capture("cudagraphs"), TorchCudaGraphs)
    assert cuda.graph_capture("inductor") is None


# ----- CUDA-graph bucketing and padding ----------------------------------------------------


def test_decode_buckets():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(6) == (1, 2, 4, 6)
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert decode_buckets(1000)[-1] == 256 and decode_buckets(30)[-2:] == (24, 30)
    buckets = decode_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket_for(65, buckets) is None


def _decode_batch(seq_lens, tables, block_size=4):
    slots = [t[(s - 1) // block_size] * block_size + (s - 1) % block_size for s, t in zip(seq_lens, tables)]
    width = max(len(t) for t in tables)
    n = len(seq_lens)
    return AttentionBatch(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_size=block_size,
        num_actual_tokens=n,
    )


def test_pad_decode_batch():
    batch = _decode_batch([5, 9, 2], [[7, 3], [1, 2, 6], [4]])
    assert is_pure_decode(batch)
    padded = pad_decode_batch(batch, 4, pad_slot=40, max_blocks_per_seq=5, max_seq_len=20)
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert padded.seq_lens.tolist() == [5, 9, 2, 1]
    assert padded.block_table.tolist() == [[7, 3, 0, 0, 0], [1, 2, 6, 0, 0], [4, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert padded.slot_mapping.tolist() == batch.slot_mapping.tolist() + [40]
    assert (padded.max_query_len, padded.max_seq_len, padded.num_actual_tokens, padded.num_seqs) == (1, 20, 4, 4)
    # a prefill, or a batch past the bucket or the table width, is refused
    prefill = dataclasses.replace(batch, max_query_len=3)
    assert not is_pure_decode(prefill)
    with pytest.raises(ValueError):
        pad_decode_batch(prefill, 4, pad_slot=40, max_blocks_per_seq=5, max_seq_len=20)
    with pytest.raises(ValueError):
        pad_decode_batch(batch, 2, pad_slot=40, max_blocks_per_seq=5, max_seq_len=20)
    with pytest.raises(ValueError):
        pad_decode_batch(batch, 4, pad_slot=40, max_blocks_per_seq=2, max_seq_len=20)


def test_same_structure_and_copy():
    @dataclasses.dataclass(frozen=True)
    class Meta:
        a: torch.Tensor
        n: int
        inner: tuple

    x = Meta(torch.zeros(3), 2, (torch.zeros(2, 2), "k"))
    y = Meta(torch.arange(3.0), 2, (torch.ones(2, 2), "k"))
    assert same_structure({"t": x}, {"t": y})
    assert not same_structure(x, Meta(torch.zeros(4), 2, (torch.zeros(2, 2), "k")))  # shape
    assert not same_structure(x, Meta(torch.zeros(3), 3, (torch.zeros(2, 2), "k")))  # an int
    assert not same_structure(x, Meta(torch.zeros(3, dtype=torch.int64), 2, (torch.zeros(2, 2), "k")))  # dtype
    a_ptr = x.a.data_ptr()
    copy_tensors({"t": x}, {"t": y})
    assert x.a.tolist() == [0.0, 1.0, 2.0] and x.inner[0].sum() == 4 and x.a.data_ptr() == a_ptr


def test_prepare_pads_only_what_a_graph_serves():
    fwd = DecodeGraphForward(torch.nn.Identity(), max_num_seqs=8, max_model_len=32, block_size=4, graphs=ReplayByRerun())
    batch = _decode_batch([5, 9, 2], [[7, 3], [1, 2, 6], [4]])
    ids, pos = torch.tensor([11, 12, 13]), torch.tensor([4, 8, 1])
    assert fwd.prepare(batch, ids, pos)[0] is batch  # no KV cache yet: no pad slot
    fwd.set_num_blocks(10)
    padded, pids, ppos = fwd.prepare(batch, ids, pos)
    assert padded.num_seqs == 4 and padded.slot_mapping[-1] == 40 and padded.block_table.shape == (4, 8)
    assert pids.tolist() == [11, 12, 13, 0] and ppos.tolist() == [4, 8, 1, 0]
    prefill = dataclasses.replace(batch, max_query_len=2, num_actual_tokens=4)
    assert fwd.prepare(prefill, ids, pos)[0] is prefill


# ----- capture and replay, on the CPU --------------------------------------------------------


class ReplayByRerun(GraphCapture):
    """Stands in for CUDA graphs: `capture` runs fn once (as the recording would) and
    `replay` re-runs it into the same output tensor, reading whatever the static input
    buffers hold then, so a buffer the forward forgets to refresh shows up as wrong tokens."""

    def __init__(self):
        self.num_captures = 0

    def capture(self, fn):
        self.num_captures += 1
        out = fn()

        class Graph:
            def replay(self_inner):
                out.copy_(fn())

        return Graph(), out


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """The Triton attention backend (static-shape metadata, as on a GPU) selectable on the
    CPU through the interpreter."""
    from portaserve.framework.plugins import Component, get_registry
    from portaserve.kernels._interpret import interpreter_env
    from portaserve.platforms.cpu.platform import CpuPlatform

    with interpreter_env():
        pytest.importorskip("triton")
        from portaserve.kernels import paged_attention, reshape_and_cache, triton_backend  # noqa: F401
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    registry = get_registry()
    backends = registry.components["attention_backends"]
    if "triton" not in backends:
        monkeypatch.setitem(backends, "triton", Component("triton", "attention_backends", "test", "portaserve.kernels.triton_backend:TritonAttentionBackend"))
    original = CpuPlatform.capabilities
    monkeypatch.setattr(CpuPlatform, "capabilities", lambda self: dataclasses.replace(
        original(self), features=original(self).features | {"triton"}, kv_cache_dtypes=original(self).kv_cache_dtypes | {"fp8"}))
    return registry


@pytest.mark.slow
def test_decode_graphs_replay_matches_eager(triton_on_cpu, checkpoint):
    from portaserve import LLM

    folder = checkpoint("Qwen2ForCausalLM", dtype="float32", tokenizer=True)
    llm = LLM(folder, device="cpu", dtype="float32", attention_backend="triton", max_model_len=64, max_num_seqs=4,
              compilation_mode="none")
    eager = _greedy(llm)
    runner = _runner(llm)
    graphs = ReplayByRerun()
    runner.forward = DecodeGraphForward(runner.model, max_num_seqs=4, max_model_len=64, block_size=runner.block_size,
                                        graphs=graphs)
    runner.initialize_kv_cache(runner.num_blocks)  # again, with the padding block
    assert runner.kv_caches[0].shape[0] == runner.num_blocks + 1
    assert _greedy(llm) == eager
    # decodes of 3 (padded to 4), 2 and 1 sequences (tokens 2-3, 4-5, 6-8): each bucket
    # captured by its first step, replayed by the others
    assert sorted(runner.forward.captured) == [1, 2, 4] and graphs.num_captures == 3
    assert runner.forward.num_replays == 4
    # the padding tokens wrote only into the reserved block
    pad_block = runner.num_blocks
    assert all(torch.isfinite(c[pad_block].float()).all() for c in runner.kv_caches)


@pytest.mark.slow
def test_fp8_kv_cache_engine(triton_on_cpu, checkpoint):
    """--kv-cache-dtype fp8 end to end where the backend declares it: an fp8 cache of half
    the bytes, and greedy tokens that mostly agree with the bf16-free float32 cache."""
    from portaserve import LLM

    folder = checkpoint("Qwen2ForCausalLM", dtype="float32", tokenizer=True)
    llm = LLM(folder, device="cpu", dtype="float32", attention_backend="triton", max_model_len=64, max_num_seqs=4,
              kv_cache_dtype="fp8", num_gpu_blocks_override=16)
    assert llm.plan.kv_cache_dtype == "fp8"
    assert all(c.dtype == torch.float8_e4m3fn for c in _runner(llm).kv_caches)
    tokens = _greedy(llm)
    assert [len(t) for t in tokens] == [8, 5, 3]


# ----- torch.compile on the CPU --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_greedy_equals_eager(checkpoint, tmp_path, monkeypatch):
    from portaserve import LLM

    monkeypatch.setenv("PORTASERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    folder = checkpoint("Qwen2ForCausalLM", dtype="float32", tokenizer=True)
    eager = _greedy(LLM(folder, dtype="float32", max_model_len=64, compilation_mode="none"))
    llm = LLM(folder, dtype="float32", max_model_len=64, compilation_mode="max")
    assert (llm.plan.compilation.name, llm.plan.compile_backend) == ("max", "inductor")
    forward = _runner(llm).forward
    assert isinstance(forward, TorchCompileForward) and len(forward.attention_layers) == 3
    torch._dynamo.utils.counters.clear()
    assert _greedy(llm) == eager  # prefill (dynamic), decode of 3, 2 and 1 sequence(s)
    # a handful of graphs (dynamic token count, plus the size-1 specialization), not one per step
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3
    # compiled artifacts went under portaserve's cache folder
    cache = tmp_path / "cache" / "compile" / "inductor"
    assert cache.is_dir() and any(cache.rglob("*.py"))
    # a second build of the same model reuses them (what makes the second start fast)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    again = LLM(folder, dtype="float32", max_model_len=64, compilation_mode="max")
    assert _greedy(again) == eager
    inductor = torch._dynamo.utils.counters["inductor"]
    assert inductor["fxgraph_cache_hit"] >= 1 and inductor["fxgraph_cache_miss"] == 0, dict(inductor)
