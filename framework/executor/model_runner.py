"""The model runner: SchedulerOutput in, sampled tokens out, on one rank.

It keeps its own record of each running request (token ids, block table, sampling
row), turns a step's SchedulerOutput into flat input tensors and one AttentionBatch,
lets every attention backend build its metadata once, runs the model, and samples the
rows that reached the end of their known tokens. Nothing here knows the device kind:
the platform, backends and allocator come from the ExecutionPlan.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from portaserve.framework.engine.scheduler_output import Logprobs, ModelRunnerOutput, SchedulerOutput
from portaserve.framework.engine.startup import EngineSpec
from portaserve.framework.executor.compile import EagerForward, build_forward
from portaserve.framework.executor.model_builder import build_model
from portaserve.framework.executor.sampler import Sampler, compute_prompt_logprobs
from portaserve.framework.executor.sampling_state import SamplingState
from portaserve.framework.interfaces import AttentionBatch, Communicator, KVCacheAllocator, Platform
from portaserve.framework.layer_context import LayerContext, StepContext
from portaserve.framework.plugins import PluginRegistry, import_object

logger = logging.getLogger("portaserve")

# Prompt logprobs need full-vocabulary logits for every prompt position; computing them
# in slices bounds the transient [rows, vocab] float32 buffer.
PROMPT_LOGPROBS_CHUNK = 256


@dataclass(slots=True)
class _RequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    prompt_logprobs: int | None = None
    is_pooling: bool = False
    prompt_logprobs_done: list[Logprobs] = field(default_factory=list)


class ModelRunner:
    """Runs the model of `spec` on one rank."""

    def __init__(
        self,
        spec: EngineSpec,
        registry: PluginRegistry,
        platform: Platform,
        local_rank: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        communicator: Communicator | None = None,
    ) -> None:
        self.spec = spec
        self.plan = spec.plan
        self.registry = registry
        self.platform = platform
        self.device = platform.torch_device(local_rank)
        self.local_rank = local_rank
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.communicator = communicator
        self.block_size = self.plan.block_size
        self.arch_cls = self.plan.model_class(registry)
        self.layer_types = list(self.arch_cls.attention_layer_types(spec.hf_config))
        # Backend instances used to build per-step metadata (stateless besides their spec).
        self.backends = LayerContext.from_plan(self.plan, registry, self.device, tp_rank, tp_size).attention_backends()
        self.model = None
        # the model's forward as the plan's compilation choice runs it (set by load_model)
        self.forward: EagerForward | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.requests: dict[str, _RequestState] = {}
        self.sampling = SamplingState()
        # the platform's features say which of the sampler's host fast paths pay off here
        self.sampler = Sampler(features=frozenset(self.plan.platform_features))
        self.allocator: KVCacheAllocator = registry.get("kv_cache_allocators", self.plan.kv_cache_allocator.name)(self.device)
        # --logits-processors: one instance per worker, applied to every request.
        self.extra_logits_processors = [import_object(name)() for name in spec.config.logits_processors or ()]

    # ----- setup -----------------------------------------------------------------------

    def load_model(self) -> None:
        self.model = build_model(
            self.plan,
            self.registry,
            self.spec.model_path,
            self.device,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            communicator=self.communicator,
        )
        backend = self.plan.compile_backend
        self.forward = build_forward(
            self.model,
            self.plan,
            max_num_seqs=self.spec.config.max_num_seqs,
            max_model_len=self.spec.max_model_len,
            is_pooling=self.spec.is_pooling,
            graph_capture=self.platform.graph_capture(backend, self.local_rank) if backend is not None else None,
        )
        if self.plan.compilation.name != "none":
            logger.info("compilation: %s", self.forward.description)

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one block takes across every attention layer of this rank."""
        return sum(self.backends[t].kv_cache_bytes_per_block() for t in self.layer_types)

    def determine_num_blocks(self) -> int:
        config = self.spec.config
        if config.num_gpu_blocks_override is not None:
            return config.num_gpu_blocks_override
        per_block = self.kv_cache_bytes_per_block()
        if per_block == 0:  # encoders keep no KV cache; blocks are bookkeeping only
            return max(1, (config.max_num_seqs * self.spec.max_model_len) // self.block_size + 1)
        budget = self.platform.kv_cache_budget_bytes(config.kv_cache_memory, self.local_rank)
        fits = self.allocator.num_blocks(budget, per_block)
        if config.kv_cache_memory is not None:
            return fits
        # Without an explicit budget, stop at what a full batch of full-length sequences
        # can use (plus the same again for cached prefixes): a small model would otherwise
        # take the whole default budget and spend start-up time touching it.
        useful = 2 * config.max_num_seqs * -(-self.spec.max_model_len // self.block_size) + 1
        return min(fits, useful)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # the forward may need blocks of its own past the scheduler's (decode graphs' padding)
        reserved = self.forward.num_reserved_blocks if self.forward is not None else 0
        if self.forward is not None:
            self.forward.set_num_blocks(num_blocks)
        shapes = [self.backends[t].kv_cache_shape(num_blocks + reserved) for t in self.layer_types]
        dtypes = [self.backends[t].kv_cache_torch_dtype() for t in self.layer_types]
        self.kv_caches = self.allocator.allocate(shapes, dtypes) if shapes else []

    def release_kv_cache(self) -> None:
        self.allocator.release(self.kv_caches)
        self.kv_caches = []

    # ----- one step --------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            if self.requests.pop(req_id, None) is not None:
                self.sampling.remove_request(req_id)
        for new in sched.new_requests:
            if new.req_id in self.requests:  # resumed after preemption without a finish notice
                self.sampling.remove_request(new.req_id)
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            params = new.sampling_params
            self.requests[new.req_id] = _RequestState(
                req_id=new.req_id,
                token_ids=tokens,
                num_prompt_tokens=len(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                prompt_logprobs=params.prompt_logprobs if params is not None else None,
                is_pooling=new.pooling_params is not None,
            )
            if params is not None and self.extra_logits_processors:
                # a copy: in-process, the scheduler's Request holds the same params object
                params = copy.copy(params)
                params.logits_processors = [*(params.logits_processors or ()), *self.extra_logits_processors]
            if params is not None:
                self.sampling.add_request(
                    new.req_id,
                    params,
                    list(new.prompt_token_ids),
                    list(new.output_token_ids),
                    frozenset(params.all_stop_token_ids),
                )
        for cached in sched.cached_requests:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput({}, {}, {}, {})
        req_ids = sched.req_ids()
        bs = self.block_size
        num_seqs = len(req_ids)
        query_lens = np.empty(num_seqs, dtype=np.int64)
        seq_lens = np.empty(num_seqs, dtype=np.int64)
        token_chunks: list[list[int]] = []
        position_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []
        max_blocks = 1
        states = [self.requests[r] for r in req_ids]
        for i, (req_id, state) in enumerate(zip(req_ids, states)):
            n = sched.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            query_lens[i] = n
            seq_lens[i] = start + n
            token_chunks.append(state.token_ids[start : start + n])
            pos = np.arange(start, start + n, dtype=np.int64)
            position_chunks.append(pos)
            if self.kv_caches:
                blocks = np.asarray(state.block_ids, dtype=np.int64)
                slot_chunks.append(blocks[pos // bs] * bs + pos % bs)
            max_blocks = max(max_blocks, len(state.block_ids))

        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        block_table = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        for i, state in enumerate(states):
            block_table[i, : len(state.block_ids)] = state.block_ids
        input_ids = torch.tensor([t for chunk in token_chunks for t in chunk], dtype=torch.long)
        positions = torch.from_numpy(np.concatenate(position_chunks))
        slot_mapping = torch.from_numpy(np.concatenate(slot_chunks)) if slot_chunks else torch.zeros(num_tokens, dtype=torch.long)
        batch = AttentionBatch(
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            block_table=torch.from_numpy(block_table),
            slot_mapping=slot_mapping,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=bs,
            num_actual_tokens=num_tokens,
        )
        forward = self.forward or EagerForward(self.model)
        # a step the forward replays from a captured graph is padded to its static shape first
        batch, input_ids, positions = forward.prepare(batch, input_ids, positions)
        metadata = {layer_type: backend.build_metadata(batch) for layer_type, backend in self.backends.items()}
        step = StepContext(attn_metadata=metadata, kv_caches=self.kv_caches, query_start_loc=batch.query_start_loc)
        hidden = forward(input_ids.to(self.device), positions.to(self.device), step)[:num_tokens]

        for state, n in zip(states, query_lens):
            state.num_computed_tokens += int(n)

        pooler_output: dict[str, tuple[float, ...]] = {}
        if self.spec.is_pooling:
            pooled = self.model.pool(hidden, step)  # [num_seqs, hidden]
            for i, state in enumerate(states):
                if state.num_computed_tokens >= len(state.token_ids):
                    pooler_output[state.req_id] = tuple(pooled[i].float().cpu().tolist())
            return ModelRunnerOutput({}, {}, {}, pooler_output)

        prompt_logprobs = self._prompt_logprobs(states, query_start_loc, hidden)

        sample_rows = [i for i, s in enumerate(states) if s.num_computed_tokens >= len(s.token_ids)]
        sampled: dict[str, int] = {}
        logprobs: dict[str, Logprobs] = {}
        errors: dict[str, str] = {}
        if sample_rows:
            index = torch.as_tensor(query_start_loc[1:][sample_rows] - 1, device=hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, index))
            sample_ids = [states[i].req_id for i in sample_rows]
            meta = self.sampling.make_metadata(sample_ids, logits.device)
            out = self.sampler(logits, meta)
            sampled_ids = out.sampled_token_ids
            if self.tp_size > 1 and self.communicator is not None:
                # Every rank must continue with the same tokens; rank 0's draw decides.
                sampled_ids = self.communicator.broadcast(sampled_ids.to(self.device).contiguous(), src=0).cpu()
            tokens = sampled_ids.tolist()
            want = {r: self.sampling.num_logprobs(r) for r in sample_ids}
            failed = dict(out.failed_rows)
            for row, (req_id, token) in enumerate(zip(sample_ids, tokens)):
                if row in failed:
                    errors[req_id] = failed[row]
                    continue
                sampled[req_id] = token
                self.requests[req_id].token_ids.append(token)
                self.sampling.append_output(req_id, token)
                k = want[req_id]
                if k is not None and out.logprobs is not None:
                    logprobs[req_id] = Logprobs(
                        token_id=token,
                        logprob=float(out.logprobs[row]),
                        rank=int(out.ranks[row]),
                        top_token_ids=tuple(out.top_token_ids[row, :k].tolist()),
                        top_logprobs=tuple(out.top_logprobs[row, :k].tolist()),
                    )
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs, pooler_output, errors)

    def _prompt_logprobs(self, states, query_start_loc, hidden) -> dict[str, tuple[Logprobs, ...]]:
        """Logprobs of each prompt token given its prefix, for requests that asked for them.

        Position p's logits predict token p + 1; the first prompt token has none (vLLM
        reports None for it — the output processor adds that entry).
        """
        out: dict[str, tuple[Logprobs, ...]] = {}
        for i, state in enumerate(states):
            k = state.prompt_logprobs
            if k is None:
                continue
            end = state.num_computed_tokens  # after this step
            start = end - int(query_start_loc[i + 1] - query_start_loc[i])
            last = min(end, state.num_prompt_tokens - 1)  # positions that predict a prompt token
            if last <= start:
                continue
            rows = torch.arange(int(query_start_loc[i]), int(query_start_loc[i]) + (last - start), device=hidden.device)
            targets = torch.tensor(state.token_ids[start + 1 : last + 1], dtype=torch.long)
            entries: list[Logprobs] = []
            for c in range(0, rows.numel(), PROMPT_LOGPROBS_CHUNK):
                logits = self.model.compute_logits(hidden.index_select(0, rows[c : c + PROMPT_LOGPROBS_CHUNK]))
                tgt = targets[c : c + PROMPT_LOGPROBS_CHUNK]
                lp, rank, top_ids, top_lp = compute_prompt_logprobs(
                    logits, tgt.to(logits.device), k, blocked=self.sampler.block_reductions
                )
                for j in range(tgt.numel()):
                    entries.append(
                        Logprobs(
                            token_id=int(tgt[j]),
                            logprob=float(lp[j]),
                            rank=int(rank[j]),
                            top_token_ids=tuple(top_ids[j].tolist()),
                            top_logprobs=tuple(top_lp[j].tolist()),
                        )
                    )
            out[state.req_id] = tuple(entries)
        return out
