"""Running a checkpoint through the real engine step path, in-process, for parity tests.

`engine(folder)` builds an EngineCore on the CPU platform with the uni executor: the
real Scheduler and BlockManager decide every step and the real ModelRunner prepares the
inputs (token ids, positions, slot mapping, block tables), runs the model and samples.
The harness only records each step's hidden states (by wrapping the runner's
`_run_model`) so that tests can compare logits at every prompt position.

The block manager's free list is shuffled (block tables are not contiguous), block 0 is
the reserved null block and the block size (8) is smaller than the prompts, so a
slot-mapping or block-table bug reads the wrong K/V and shows up as a parity failure.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from portaserve.framework.checkpoint import load_hf_config
from portaserve.framework.config import EngineConfig
from portaserve.framework.engine.core import EngineCore
from portaserve.framework.engine.params import PoolingParams, SamplingParams
from portaserve.framework.engine.request import Request
from portaserve.framework.engine.startup import resolve_engine
from portaserve.framework.executor.input_batch import ModelInputs
from portaserve.framework.executor.model_runner import ModelRunner
from portaserve.framework.plan import resolve_plan
from portaserve.framework.plugins import get_registry
from portaserve.framework.selection import choose_platform


def make_plan(model_dir: str | Path, **config):
    """The ExecutionPlan (and registry) for `config` (EngineConfig fields; CPU, block size 8
    unless given), resolved without loading anything."""
    registry = get_registry()
    config = EngineConfig.create(model=str(model_dir), **{"device": "cpu", "block_size": 8, **config})
    choice = choose_platform(registry, config.device)
    return resolve_plan(config, registry, choice, load_hf_config(model_dir)), registry


class Engine:
    """An in-process EngineCore whose runner's hidden states are recorded step by step."""

    def __init__(self, core: EngineCore, seed: int = 0) -> None:
        self.core = core
        self.runner: ModelRunner = core.executor.worker.runner
        self.model = self.runner.model
        # non-contiguous block tables: hand out the free blocks in a shuffled order
        random.Random(seed).shuffle(core.block_manager._free_uncached)
        self.steps: list[tuple[ModelInputs, torch.Tensor]] = []
        run_model = self.runner._run_model

        def recording(inputs: ModelInputs) -> torch.Tensor:
            hidden = run_model(inputs)
            self.steps.append((inputs, hidden))
            return hidden

        self.runner._run_model = recording
        self._ids = itertools.count()

    def run(self, requests: Sequence[Request], token_budget: int | None = None) -> dict[str, list]:
        """Add `requests` and step until all finish; `token_budget` is the scheduler's
        tokens per step (chunked prefill when it is smaller than a prompt).

        :returns: each request's EngineCoreOutputs, by request id.
        """
        scheduler = self.core.scheduler
        scheduler.max_num_batched_tokens = token_budget or max(2048, sum(len(r.prompt_token_ids) for r in requests))
        outputs: dict[str, list] = {r.request_id: [] for r in requests}
        for request in requests:
            self.core.add_request(request)
        while self.core.has_unfinished_requests():
            for out in self.core.step():
                outputs[out.req_id].append(out)
        return outputs

    def new_id(self) -> str:
        return f"r{next(self._ids)}"


def engine(model_dir: str | Path, *, max_model_len: int | None = None, seed: int = 0, **config) -> Engine:
    """The checkpoint's model behind a real EngineCore on the CPU; `config` goes to
    EngineConfig (dtype, quantization, ...) over the harness's defaults: float32, block
    size 8, 256 blocks, prefix caching off (every prompt position is computed).
    `max_model_len` may exceed the checkpoint's max_position_embeddings (transformers runs
    past it too)."""
    defaults = dict(device="cpu", dtype="float32", block_size=8, num_gpu_blocks_override=256,
                    enable_prefix_caching=False, enable_chunked_prefill=True, max_num_seqs=32)
    spec = resolve_engine(EngineConfig.create(model=str(model_dir), **{**defaults, **config}))
    if max_model_len is not None:
        spec = dataclasses.replace(spec, max_model_len=max_model_len)
    return Engine(EngineCore(spec), seed=seed)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def prompt_logits(eng: Engine, prompts: Sequence[Sequence[int]], token_budget: int | None = None) -> list[torch.Tensor]:
    """Float32 logits at every prompt position, prompts batched together; with
    `token_budget`, prompts are prefilled in chunks over several steps."""
    requests = [Request(eng.new_id(), list(p), sampling_params=_greedy(1), max_tokens=1) for p in prompts]
    first = len(eng.steps)
    eng.run(requests, token_budget)
    pieces: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in requests}
    with torch.inference_mode():
        for inputs, hidden in eng.steps[first:]:
            qsl = inputs.query_start_loc.tolist()
            for i, req_id in enumerate(inputs.req_ids):
                if req_id in pieces:  # max_tokens 1: every row computed is a prompt position
                    pieces[req_id].append(eng.model.compute_logits(hidden[qsl[i] : qsl[i + 1]]).float())
    return [torch.cat(pieces[r.request_id]) for r in requests]


def greedy_generate(
    eng: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, token_budget: int | None = None
) -> list[list[int]]:
    """Greedy continuation of every prompt, sampled by the runner's sampler; with a small
    `token_budget`, prefill chunks and decodes share steps."""
    requests = [
        Request(eng.new_id(), list(p), sampling_params=_greedy(max_new_tokens), max_tokens=max_new_tokens)
        for p in prompts
    ]
    outputs = eng.run(requests, token_budget)
    return [[t for out in outputs[r.request_id] for t in out.new_token_ids] for r in requests]


def embeddings(eng: Engine, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The pooled embedding of each prompt, as the runner's `_pool` returns it."""
    requests = [Request(eng.new_id(), list(p), pooling_params=PoolingParams()) for p in prompts]
    outputs = eng.run(requests)
    pooled = [next(o.pooler_output for o in outputs[r.request_id] if o.pooler_output is not None) for r in requests]
    return [torch.tensor(p) for p in pooled]
