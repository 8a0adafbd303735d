"""Conformance: the platform's graph recorders (`PlatformCapabilities.graph_backends`,
`Platform.graph_capture`, contract 1.3).

- Every declared graph backend is a compile backend, and `graph_capture` returns a
  `GraphCapture` for it (and None for the torch.compile backends).
- A recording either replays what the callable computes from the inputs' new values, or
  the recorder refuses with `GraphCaptureUnsupported` (a recorder may replay only its own
  kernels, as the CPU's does); it never records something that replays wrong.
- The engine with that compile mode decodes the same greedy tokens as eager, with batches
  shrinking through every recorded size; it either replayed steps or said why not.
"""

from __future__ import annotations

import pytest
import torch

from portaserve.framework.interfaces import GraphCapture, GraphCaptureUnsupported

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33], [40], [50, 51, 52]]


def _graph_modes(platform) -> list[tuple[str, str]]:
    caps = platform.capabilities()
    return sorted((mode, backend) for mode, backend in caps.compile_backends.items() if backend in caps.graph_backends)


def test_graph_backends_are_declared_compile_backends(platform):
    caps = platform.capabilities()
    assert caps.graph_backends <= set(caps.compile_backends.values()), (caps.graph_backends, caps.compile_backends)
    for backend in set(caps.compile_backends.values()):
        recorder = platform.graph_capture(backend, 0)
        if backend in caps.graph_backends:
            assert isinstance(recorder, GraphCapture), f"graph backend {backend!r}: graph_capture returned {recorder!r}"
            sizes = recorder.batch_sizes
            assert sizes is None or (sizes and all(isinstance(s, int) and s >= 1 for s in sizes)
                                     and list(sizes) == sorted(set(sizes))), sizes
        else:
            assert recorder is None, f"{backend!r} is a torch.compile backend, yet graph_capture returned {recorder!r}"


def test_a_recording_replays_the_new_inputs_or_is_refused(platform, device):
    modes = _graph_modes(platform)
    if not modes:
        pytest.skip(f"platform {platform.name} declares no graph recorder")
    for _mode, backend in modes:
        recorder = platform.graph_capture(backend, 0)
        x = torch.arange(8, dtype=torch.float32, device=device)
        fn = lambda: x * 2 + 1  # noqa: E731
        fn()  # the contract: the caller has run it eagerly once
        try:
            graph, out = recorder.capture(fn)
        except GraphCaptureUnsupported:
            continue  # allowed: this recorder replays only its own kernels
        x.copy_(torch.full((8,), 3.0, device=device))
        graph.replay()
        assert torch.equal(out.cpu(), torch.full((8,), 7.0)), f"{backend}: the replay did not read the new input"


@pytest.mark.timeout(600)
def test_engine_decodes_the_same_with_graphs(platform, registry, tmp_path):
    modes = _graph_modes(platform)
    if not modes:
        pytest.skip(f"platform {platform.name} declares no graph recorder")
    from portaserve import LLM, SamplingParams

    arch = "LlamaForCausalLM"
    registry.get("checkpoint_writers", arch)(str(tmp_path), "tiny", 0)
    dtype = "float32" if torch.float32 in platform.capabilities().dtypes else "bfloat16"
    # max_tokens differ, so the decode batch shrinks one sequence at a time
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    results = {}
    for mode in ["none", *(m for m, _ in modes)]:
        llm = LLM(str(tmp_path), device=platform.name, dtype=dtype, compilation_mode=mode, kv_cache_memory=0.25)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            forward = llm.llm_engine.core.executor.worker.runner.forward
        finally:
            llm.shutdown()
        results[mode] = [list(o.outputs[0].token_ids) for o in outs]
        if mode != "none":
            replays = getattr(forward, "num_replays", 0)
            reason = getattr(forward, "unsupported_reason", None)
            assert replays > 0 or reason, f"mode {mode}: no decode step was replayed and no reason was given"
    for mode, _backend in modes:
        if dtype == "float32":  # low precision may flip a near-tie between orders of work
            assert results[mode] == results["none"], f"compilation mode {mode}: greedy tokens differ from eager"
