"""CPU decode graphs (platforms/cpu/graphs.py, graph_replay.c): recorded C kernel calls
replayed in one call, and the KV-cache write kernel they need."""

from __future__ import annotations

import pytest
import torch

from portaserve.framework.executor.decode_graphs import DecodeGraphForward
from portaserve.framework.interfaces import GraphCaptureUnsupported
from portaserve.platforms.cpu import fused_ops, native
from portaserve.platforms.cpu.attention import CpuPagedAttentionBackend
from portaserve.platforms.cpu.graphs import KERNEL_IDS, OUTSIDE_FORWARD, QUERIES, CpuGraph, CpuGraphs

kernels = native.load()
pytestmark = pytest.mark.skipif(kernels is None, reason=f"no C kernels: {native.unavailable_reason()}")


def test_every_entry_point_is_recorded_queried_or_refused():
    """A new C entry point must be given a replay case (graph_replay.c) or be declared a
    query; anything else refuses capture, which would silently turn graphs off."""
    assert set(native.entry_points()) == set(KERNEL_IDS) | QUERIES | OUTSIDE_FORWARD | {"graph_replay"}
    assert "graph_replay" not in KERNEL_IDS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_matches_index_copy(dtype):
    torch.manual_seed(0)
    tokens, heads, d = 5, 3, 64
    table = torch.randn(200, d).to(dtype)
    rows = torch.randperm(200)[: 2 * tokens * heads].view(2, tokens * heads)
    k = torch.randn(tokens, heads, d).to(dtype)
    qkv = torch.randn(tokens, 7 * d).to(dtype)
    v = qkv[:, 4 * d :].view(tokens, heads, d)  # a strided view, like the V slice of qkv
    want = table.clone()
    want.index_copy_(0, rows[0], k.reshape(-1, d))
    want.index_copy_(0, rows[1], v.reshape(-1, d))
    rc = kernels.kv_write(table.data_ptr(), rows[0].data_ptr(), rows[1].data_ptr(), k.data_ptr(), k.stride(0),
                          k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), tokens, heads, d, k.element_size())
    assert rc == 0 and torch.equal(table, want)
    bad = rows.clone()
    bad[1, 2] = -1
    assert kernels.kv_write(table.data_ptr(), bad[0].data_ptr(), bad[1].data_ptr(), k.data_ptr(), k.stride(0),
                            k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), tokens, heads, d, k.element_size()) == 1


def test_a_failing_replay_names_the_call_and_kernel():
    table, k = torch.zeros(4, 8), torch.ones(1, 1, 8)
    rows = torch.tensor([[0], [-1]])  # a negative V row: ps_kv_write returns 1
    args = [table.data_ptr(), rows[0].data_ptr(), rows[1].data_ptr(), k.data_ptr(), 8, 8, k.data_ptr(), 8, 8, 1, 1, 8, 4]
    graph = CpuGraph(kernels, [(KERNEL_IDS["kv_write"], args)], [table, rows, k])
    with pytest.raises(RuntimeError, match=r"call 0 \(kv_write\): code 1001"):
        graph.replay()
    with pytest.raises(RuntimeError, match=r"call 0 \(\?\): code -1"):
        CpuGraph(kernels, [(99, [])], []).replay()


def _norm_then_act(x, w):
    """Two recorded kernels and the allocations between them."""
    h = fused_ops.rms_norm(x, w, 1e-6)
    return fused_ops.silu_and_mul(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replay_recomputes_from_the_inputs_current_values(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 128).to(dtype)
    w = torch.randn(128).to(dtype)
    want = _norm_then_act(x, w)  # the eager run the contract asks for first
    graph, out = CpuGraphs(kernels).capture(lambda: _norm_then_act(x, w))
    assert graph.num_ops == 2 and torch.equal(out, want)
    x.copy_(torch.randn(3, 128).to(dtype))
    graph.replay()
    assert torch.equal(out, _norm_then_act(x, w))  # the new input, through the recorded calls
    # the recording owns its intermediates: collecting garbage does not invalidate it
    import gc

    gc.collect()
    graph.replay()
    assert torch.equal(out, _norm_then_act(x, w))


def test_recordings_share_one_arena_and_each_replays_right():
    """Tensors made while recording come from one arena that every recording reuses from
    its start (replays never overlap): two recordings reserve one recording's memory, and
    replaying them in turn gives each its own right answer."""
    torch.manual_seed(0)
    w = torch.randn(256).to(torch.bfloat16)
    xa, xb = torch.randn(3, 256).to(torch.bfloat16), torch.randn(5, 256).to(torch.bfloat16)
    graphs = CpuGraphs(kernels)
    _norm_then_act(xb, w)  # the eager run the contract asks for first (the kernels' workspaces)
    ga, out_a = graphs.capture(lambda: _norm_then_act(xa, w))
    reserved = graphs.arena.reserved_bytes
    gb, out_b = graphs.capture(lambda: _norm_then_act(xb, w))
    assert graphs.arena.reserved_bytes == reserved > 0
    chunk = graphs.arena.chunks[0]
    for out in (out_a, out_b):  # both in the same arena bytes: each replay rewrites them
        assert chunk.data_ptr() <= out.data_ptr() < chunk.data_ptr() + chunk.numel()
    for x, graph, out in ((xa, ga, out_a), (xb, gb, out_b), (xa, ga, out_a)):
        x.copy_(torch.randn(x.shape).to(torch.bfloat16))
        graph.replay()
        assert torch.equal(out, _norm_then_act(x, w))


def test_a_tensor_made_while_recording_must_not_outlive_the_step():
    """A workspace grown lazily while recording would sit in arena bytes the next
    recording reuses: refused, naming the cause."""
    w = torch.randn(3000)
    x = torch.randn(2, 3000)
    kept = []

    def step():
        kept.append(torch.empty(8))  # a cache filled during the step
        return fused_ops.rms_norm(x, w, 1e-6)

    with pytest.raises(GraphCaptureUnsupported, match="outlive the step"):
        CpuGraphs(kernels).capture(step)


def test_a_recording_past_the_memory_limit_is_refused():
    x, w = torch.randn(64, 4096), torch.randn(4096)
    with pytest.raises(GraphCaptureUnsupported, match="PORTASERVE_CPU_GRAPH_MEMORY_MB"):
        CpuGraphs(kernels, memory_bytes=512 << 10).capture(lambda: fused_ops.rms_norm(x, w, 1e-6))


def test_capture_refuses_work_it_cannot_replay():
    x, w = torch.randn(2, 64), torch.randn(64)
    graphs = CpuGraphs(kernels)
    with pytest.raises(GraphCaptureUnsupported, match="aten.add"):
        graphs.capture(lambda: fused_ops.rms_norm(x + 1, w, 1e-6))  # a torch op: not recorded
    with pytest.raises(GraphCaptureUnsupported, match="_local_scalar_dense"):
        graphs.capture(lambda: fused_ops.rms_norm(x, w, float(x[0, 0])))  # a value read back
    with pytest.raises(GraphCaptureUnsupported, match="not one tensor"):
        graphs.capture(lambda: (fused_ops.rms_norm(x, w, 1e-6),))
    with pytest.raises(GraphCaptureUnsupported, match="not available"):
        CpuGraphs(None).capture(lambda: fused_ops.rms_norm(x, w, 1e-6))
    # the recorder restored the kernels: eager calls run as before
    assert kernels.rms_norm is getattr(kernels.lib, "ps_rms_norm")


def _engine_outputs(path, prompts, params, **kw):
    from portaserve import LLM

    llm = LLM(str(path), dtype="float32", **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        forward = llm.llm_engine.core.executor.worker.runner.forward
        forward.preemptions = llm.llm_engine.core.scheduler.num_preemptions
        return [(list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
                for o in outs], forward
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
def test_graph_decode_equals_eager_on_a_quantized_gguf(tmp_path, monkeypatch):
    """The default engine on a GGUF file replays decode steps of 1-32 sequences from
    recordings: the same tokens and log-probabilities as eager, while batches shrink from
    10 sequences to 1, contexts cross several attention parts (the part length is cut to
    16 keys here), and a tight KV budget preempts sequences."""
    from portaserve import SamplingParams
    from model_files.test_gguf_quantized_models import MIXES, write_mixed  # tests/ is on sys.path (its conftest)

    monkeypatch.setattr(CpuPagedAttentionBackend, "native_part_len", 16)
    path = write_mixed(tmp_path / "mix.gguf", MIXES["k_quant_mix"])
    prompts = [[5 + i, 70, 99, 120 + i, 33][: 2 + i % 4] * (1 + i % 3) for i in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 6 * i, ignore_eos=True, logprobs=1) for i in range(10)]
    eager, forward = _engine_outputs(path, prompts, params, compilation_mode="none", num_gpu_blocks_override=14)
    assert type(forward).__name__ == "EagerForward"
    graphs, forward = _engine_outputs(path, prompts, params, num_gpu_blocks_override=14)
    assert isinstance(forward, DecodeGraphForward) and forward.buckets == tuple(range(1, 33))
    assert not forward.unsupported and forward.num_replays > 50 and len(forward.captured) >= 8
    assert forward.preemptions > 0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(graphs, eager, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-6)


@pytest.mark.timeout(300)
def test_a_model_with_unrecordable_work_decodes_eagerly(checkpoint):
    """A dense model multiplies through oneDNN (torch ops), which a recording cannot
    replay: the engine keeps every decode eager and says why, with the same outputs."""
    from portaserve import SamplingParams

    folder = checkpoint("Qwen2ForCausalLM", dtype="float32", tokenizer=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    eager, _ = _engine_outputs(folder, prompts, params, compilation_mode="none")
    outs, forward = _engine_outputs(folder, prompts, params)
    assert isinstance(forward, DecodeGraphForward) and forward.num_replays == 0
    # refused at the first decode batch (2 sequences): that size and every larger one
    assert forward.unsupported == set(range(2, 33)) and "cannot replay" in forward.unsupported_reason
    assert outs == eager
