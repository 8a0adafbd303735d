"""Running a model through the paged KV cache without the engine: a trivial block
allocator and hand-built AttentionBatch / StepContext per step.

Blocks are handed out in a shuffled order (block tables are not contiguous) and block 0
is never used, so a slot-mapping or block-table bug reads the wrong K/V and shows up as
a parity failure.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from portaserve.framework.checkpoint import load_hf_config
from portaserve.framework.config import EngineConfig
from portaserve.framework.executor.model_builder import build_model
from portaserve.framework.interfaces import AttentionBatch
from portaserve.framework.layer_context import LayerContext, StepContext
from portaserve.framework.plan import resolve_plan
from portaserve.framework.plugins import get_registry
from portaserve.framework.selection import choose_platform


def make_plan(model_dir: str | Path, *, dtype: str = "float32", block_size: int = 8, device: str = "cpu"):
    registry = get_registry()
    config = EngineConfig.create(model=str(model_dir), device=device, dtype=dtype, block_size=block_size)
    choice = choose_platform(registry, device)
    return resolve_plan(config, registry, choice, load_hf_config(model_dir)), registry


def paged_runner(model_dir: str | Path, *, dtype: str = "float32", block_size: int = 8, device: str = "cpu",
                 num_blocks: int = 256, tp_rank: int = 0, tp_size: int = 1, communicator=None) -> "PagedRunner":
    """Build the checkpoint's model under a CPU plan (this rank's shard) and wrap it in a PagedRunner."""
    plan, registry = make_plan(model_dir, dtype=dtype, block_size=block_size, device=device)
    model = build_model(plan, registry, model_dir, torch.device(device), tp_rank, tp_size, communicator, progress=False)
    return PagedRunner(model, plan, registry, load_hf_config(model_dir), num_blocks=num_blocks, device=device,
                       tp_rank=tp_rank, tp_size=tp_size)


@dataclass
class _Seq:
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedRunner:
    """Drives `model` step by step over a paged KV cache it owns."""

    def __init__(self, model, plan, registry, hf_config, *, num_blocks: int = 256, device: str = "cpu", seed: int = 0,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_size = plan.block_size
        arch = plan.model_class(registry)
        self.layer_types = arch.attention_layer_types(hf_config)
        # this rank's heads: the KV cache holds only this rank's share
        self.backends = LayerContext.from_plan(plan, registry, self.device, tp_rank, tp_size).attention_backends()
        self.kv_caches = [
            torch.zeros(self.backends[t].kv_cache_shape(num_blocks), dtype=self.backends[t].kv_cache_torch_dtype(), device=self.device)
            for t in self.layer_types
        ]
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.seqs: dict[int, _Seq] = {}

    def add(self, seq_id: int, tokens: Sequence[int]) -> None:
        self.seqs[seq_id] = _Seq(list(tokens))

    def append(self, seq_id: int, token: int) -> None:
        self.seqs[seq_id].tokens.append(token)

    def step(self, work: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """Run one forward: `work` is (seq_id, num_new_tokens) per sequence, in batch order.

        :returns: the hidden states of each sequence's new tokens, [num_new, hidden] each.
        """
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        qsl, seq_lens, tables = [0], [], []
        for seq_id, n in work:
            seq = self.seqs[seq_id]
            start = seq.num_computed
            end = start + n
            if end > len(seq.tokens):
                raise ValueError(f"sequence {seq_id} has {len(seq.tokens)} tokens, asked to compute up to {end}")
            while len(seq.blocks) * bs < end:
                seq.blocks.append(self.free.pop())
            for pos in range(start, end):
                input_ids.append(seq.tokens[pos])
                positions.append(pos)
                slots.append(seq.blocks[pos // bs] * bs + pos % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            tables.append(seq.blocks)
        width = max(len(t) for t in tables)
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        batch = AttentionBatch(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(n for _, n in work),
            max_seq_len=max(seq_lens),
            block_size=bs,
            num_actual_tokens=len(input_ids),
        )
        metadata = {t: b.build_metadata(batch) for t, b in self.backends.items()}
        step = StepContext(attn_metadata=metadata, kv_caches=self.kv_caches, query_start_loc=batch.query_start_loc)
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                step,
            )
        for seq_id, n in work:
            self.seqs[seq_id].num_computed += n
        return list(hidden.split([n for _, n in work]))


def prompt_logits(runner: PagedRunner, prompts: Sequence[Sequence[int]], chunk: int | None = None) -> list[torch.Tensor]:
    """Float32 logits at every prompt position, prompts batched together; with `chunk`,
    prompts are fed `chunk` tokens per step (chunked prefill across several steps)."""
    base = len(runner.seqs)
    for i, p in enumerate(prompts):
        runner.add(base + i, p)
    pieces: list[list[torch.Tensor]] = [[] for _ in prompts]
    remaining = [len(p) for p in prompts]
    while any(remaining):
        work = [(base + i, min(r, chunk or r)) for i, r in enumerate(remaining) if r]
        hidden = runner.step(work)
        for (seq_id, n), h in zip(work, hidden):
            i = seq_id - base
            with torch.inference_mode():
                pieces[i].append(runner.model.compute_logits(h))
            remaining[i] -= n
    return [torch.cat(p) for p in pieces]


def greedy_generate(
    runner: PagedRunner, prompts: Sequence[Sequence[int]], max_new_tokens: int, chunk: int | None = None
) -> list[list[int]]:
    """Greedy continuation of every prompt, all in one batch: prefill (in chunks of
    `chunk` tokens when given, so prefill chunks and decodes share steps), then decodes."""
    base = len(runner.seqs)
    for i, p in enumerate(prompts):
        runner.add(base + i, p)
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < max_new_tokens for o in outputs):
        work = []
        for i in range(len(prompts)):
            if len(outputs[i]) >= max_new_tokens:
                continue
            seq = runner.seqs[base + i]
            left = len(seq.tokens) - seq.num_computed
            work.append((base + i, min(left, chunk) if chunk else left))
        hidden = runner.step(work)
        # a prefill chunk that does not reach the end of its prompt samples nothing
        done = [(seq_id, h[-1]) for (seq_id, _), h in zip(work, hidden)
                if runner.seqs[seq_id].num_computed == len(runner.seqs[seq_id].tokens)]
        if not done:
            continue
        with torch.inference_mode():
            tokens = runner.model.compute_logits(torch.stack([h for _, h in done])).argmax(-1).tolist()
        for (seq_id, _), token in zip(done, tokens):
            outputs[seq_id - base].append(token)
            runner.append(seq_id, token)
    return outputs
