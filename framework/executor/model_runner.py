"""The model runner: SchedulerOutput in, sampled tokens out, on one rank.

It keeps its own record of each running request (token ids, block table, sampling
row). A step runs in three parts: `_prepare_inputs` turns the SchedulerOutput into flat
input tensors and one AttentionBatch (input_batch.py) and lets every attention backend
build its metadata once; `_run_model` runs the forward; `_sample` (or `_pool`, for an
encoder) handles the rows that reached the end of their known tokens. Nothing here knows
the device kind: the platform, backends and allocator come from the ExecutionPlan.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import numpy as np
import torch

from portaserve.framework.engine.scheduler_output import DRAFT_MODEL_SLOT, Logprobs, ModelRunnerOutput, SchedulerOutput
from portaserve.framework.engine.startup import EngineSpec, default_num_batched_tokens
from portaserve.framework.executor.compile import EagerForward, build_forward
from portaserve.framework.executor.draft_model import DraftModel
from portaserve.framework.executor.input_batch import ModelInputs, RequestState, build_inputs
from portaserve.framework.executor.model_builder import build_model
from portaserve.framework.executor.sampler import Sampler, compute_prompt_logprobs
from portaserve.framework.executor.sampling_state import SamplingState
from portaserve.framework.executor.speculation import decode_rows, verify
from portaserve.framework.interfaces import Communicator, KVCacheAllocator, Platform
from portaserve.framework.layer_context import LayerContext, StepContext
from portaserve.framework.lora.manager import LoRAManager, LoRAState
from portaserve.framework.plugins import PluginRegistry, import_object

logger = logging.getLogger("portaserve")

# Prompt logprobs need full-vocabulary logits for every prompt position; computing them
# in slices bounds the transient [rows, vocab] float32 buffer.
PROMPT_LOGPROBS_CHUNK = 256


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
        context = LayerContext.from_plan(self.plan, registry, self.device, tp_rank, tp_size)
        self.backends = context.attention_backends()
        # structured outputs' mask on the logits (the platform's kernel or the torch reference)
        self._apply_token_bitmask = context.ops.get("apply_token_bitmask")
        self._grammar: tuple[tuple[str, ...], bytes, tuple[int, ...]] = ((), b"", ())
        # The backends whose metadata a step needs: those of the decoder's layers (a vision
        # tower builds its own per batch of images); every one for an encoder-only model.
        self.step_backends = {t: b for t, b in self.backends.items() if t in self.layer_types or not self.layer_types}
        self.model = None
        # the model's forward as the plan's compilation choice runs it (set by load_model)
        self.forward: EagerForward | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.requests: dict[str, RequestState] = {}
        self.sampling = SamplingState()
        # the platform's features say which of the sampler's host fast paths pay off here
        self.sampler = Sampler(features=frozenset(self.plan.platform_features))
        self.allocator: KVCacheAllocator = registry.get("kv_cache_allocators", self.plan.kv_cache_allocator.name)(self.device)
        # --logits-processors: one instance per worker, applied to every request.
        self.extra_logits_processors = [import_object(name)() for name in spec.config.logits_processors or ()]
        # image hash -> the model's embeddings of it [num_tokens, hidden]; what it holds is
        # decided by the scheduler's EncoderCacheManager (SchedulerOutput.free_encoder_hashes)
        self.encoder_cache: dict[str, torch.Tensor] = {}
        # LoRA adapters (framework/lora): the layers' shared state and the slot manager
        self.lora_state = LoRAState(spec.config.max_loras, spec.config.max_lora_rank) if spec.config.enable_lora else None
        self.lora = None
        self._lora_errors: dict[str, str] = {}  # this step's requests whose adapter failed to load
        # speculative decoding's draft model, when the config names one (draft_model.py)
        self.drafter = DraftModel(
            spec.draft, registry, platform, local_rank, tp_rank, tp_size, communicator,
            max_tokens_per_step=default_num_batched_tokens(spec), max_num_seqs=spec.config.max_num_seqs,
            num_speculative_tokens=spec.config.speculative_config["num_speculative_tokens"]) if spec.draft else None

    # ----- setup -----------------------------------------------------------------------

    def load_model(self) -> None:
        # One host thread fewer while loading: `serve`'s front end starts on a core of its
        # own meanwhile, and the load's many small host ops gain nothing from the last
        # thread (SmolLM2's GGUF on 2 cores: 0.83 s with one thread, 1.0-3.7 s with two).
        threads = torch.get_num_threads()
        if threads > 1:
            torch.set_num_threads(threads - 1)
        try:
            self.model = build_model(
                self.plan,
                self.registry,
                self.spec.model_path,
                self.device,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                communicator=self.communicator,
                lora=self.lora_state,
            )
        finally:
            if threads > 1:
                torch.set_num_threads(threads)
        if self.drafter is not None:
            self.drafter.load()
        if self.lora_state is not None:
            self.lora = LoRAManager(self.lora_state, self.spec.config.max_cpu_loras)
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
        """Bytes one block takes across every attention layer of this rank (the draft
        model's too: its cache has as many blocks)."""
        draft = self.drafter.kv_cache_bytes_per_block() if self.drafter is not None else 0
        return sum(self.backends[t].kv_cache_bytes_per_block() for t in self.layer_types) + draft

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
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(self.allocator, num_blocks)

    def release_kv_cache(self) -> None:
        self.allocator.release(self.kv_caches)
        self.kv_caches = []
        if self.drafter is not None:
            self.drafter.release_kv_cache(self.allocator)

    # ----- one step --------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            if self.requests.pop(req_id, None) is not None:
                self.sampling.remove_request(req_id)
            if self.drafter is not None:
                self.drafter.forget(req_id)
        for new in sched.new_requests:
            if self.drafter is not None:  # new, or resumed with other blocks
                self.drafter.forget(new.req_id)
                if new.sampling_params is not None and new.sampling_params.structured_outputs is not None:
                    self.drafter.never.add(new.req_id)  # the scheduler never proposes for it (may_speculate)
            if new.req_id in self.requests:  # resumed after preemption without a finish notice
                self.sampling.remove_request(new.req_id)
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            params = new.sampling_params
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                token_ids=tokens,
                num_prompt_tokens=len(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                prompt_logprobs=params.prompt_logprobs if params is not None else None,
                is_pooling=new.pooling_params is not None,
                mm_features=new.mm_features,
                lora_id=new.lora_request.lora_int_id if new.lora_request is not None else 0,
            )
            if new.lora_request is not None:
                self.lora.remember(new.lora_request)
            if new.mm_features and hasattr(self.model, "rope_positions"):
                self.requests[new.req_id].rope_positions = self.model.rope_positions(len(new.prompt_token_ids),
                                                                                     new.mm_features)
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
        """One step: update the request records, prepare the inputs, run the model, then
        pool or sample the requests that reached the end of their known tokens."""
        self._update_states(sched)
        for key in sched.free_encoder_hashes:
            self.encoder_cache.pop(key, None)
        if sched.is_empty:
            return ModelRunnerOutput()
        if self.lora_state is not None:
            self.lora_state.token_slots = None  # a vision tower never runs adapters
        if sched.scheduled_encoder_inputs:
            self._run_encoder(sched.scheduled_encoder_inputs)
        self._grammar = (sched.grammar_req_ids, sched.grammar_bitmask, sched.grammar_rows)
        drafts = self._fill_drafts(sched.spec_token_ids)
        for req_id, proposed in drafts.items():  # verified in this step (speculation.py)
            self.requests[req_id].token_ids.extend(proposed)
        inputs = self._prepare_inputs(sched, drafts)
        hidden = self._run_model(inputs)
        for state, n in zip(inputs.states, inputs.query_lens.tolist()):
            state.num_computed_tokens += n
        if self.drafter is not None:  # the draft computes the prompt chunks the target just did
            self.drafter.follow([s for s in inputs.states if s.req_id not in drafts])
        if self.spec.is_pooling:
            return ModelRunnerOutput(pooler_output=self._pool(inputs, hidden))
        prompt_logprobs = self._prompt_logprobs(inputs.states, inputs.query_start_loc, hidden)
        # one sampling path: a step without proposals is a verification of none
        out = verify(self, inputs, hidden, prompt_logprobs, drafts)
        if self._lora_errors:  # they ran on the base weights: their tokens are not output
            errors, self._lora_errors = {**out.errors, **self._lora_errors}, {}
            out = dataclasses.replace(out, errors=errors,
                                      sampled_token_ids={r: t for r, t in out.sampled_token_ids.items() if r not in errors})
        return out

    def _fill_drafts(self, spec_token_ids):
        """The step's proposals, the draft model's made now (its places are DRAFT_MODEL_SLOT)."""
        wanted = {r: len(d) for r, d in spec_token_ids.items() if d and d[0] == DRAFT_MODEL_SLOT}
        if not wanted:
            return spec_token_ids
        made = self.drafter.propose([self.requests[r] for r in wanted], list(wanted.values()))
        return {**spec_token_ids, **made}

    def _prepare_inputs(self, sched: SchedulerOutput, drafts=None) -> ModelInputs:
        """The step's inputs on the device, padded as the forward replays them, with every
        attention backend's metadata built once."""
        req_ids = tuple(sched.req_ids())
        states = tuple(self.requests[r] for r in req_ids)
        counts = [sched.num_scheduled_tokens[r] for r in req_ids]
        if drafts:
            # a request's last token and its proposals attend as that many one-token queries
            # (speculation.py): each row runs the decode path it would run without speculation
            host = decode_rows(states, counts, drafts, self.block_size, bool(self.kv_caches))
        else:
            host = build_inputs(states, counts, self.block_size, with_kv_cache=bool(self.kv_caches))
        rope_3d, positions = self._rope_positions(states, host.positions, host.query_start_loc)
        # a step the forward replays from a captured graph is padded to its static shape first
        batch, input_ids, positions = self._forward().prepare(host.batch, host.input_ids, positions)
        if rope_3d is not None:  # a step with image tokens: never padded (it is not a pure decode)
            positions = rope_3d
        metadata = {layer_type: backend.build_metadata(batch) for layer_type, backend in self.step_backends.items()}
        mm_embeds = self._gather_mm_embeds(states, host.query_start_loc)
        self._set_lora_slots(states, host.query_start_loc, input_ids.shape[0])
        return ModelInputs(
            req_ids=req_ids,
            states=states,
            input_ids=input_ids.to(self.device),
            positions=positions.to(self.device),
            step=StepContext(attn_metadata=metadata, kv_caches=self.kv_caches, query_start_loc=batch.query_start_loc,
                             mm_embeds=mm_embeds),
            query_start_loc=host.query_start_loc,
            num_tokens=host.batch.num_actual_tokens,
        )

    @staticmethod
    def _rope_positions(states, positions: torch.Tensor, query_start_loc) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Multimodal RoPE positions of the step's tokens: ([3, n] or None, 1-D positions).
        Where every token's three parts agree (text, and everything after the prompt) the
        1-D positions carry them (shifted), so such steps run like a plain decoder's."""
        if not any(s.rope_positions is not None for s in states):
            return None, positions
        flat = positions.numpy()
        out = np.broadcast_to(flat, (3, flat.shape[0])).copy()
        for i, state in enumerate(states):
            if state.rope_positions is None:
                continue
            prompt, shift = state.rope_positions
            rows = slice(int(query_start_loc[i]), int(query_start_loc[i + 1]))
            index = flat[rows]
            in_prompt = index < prompt.shape[1]
            values = np.broadcast_to(index + shift, (3, index.shape[0])).copy()
            values[:, in_prompt] = prompt[:, index[in_prompt]]
            out[:, rows] = values
        one_d = torch.from_numpy(np.ascontiguousarray(out[0]))
        if (out[0] == out[1]).all() and (out[0] == out[2]).all():
            return None, one_d
        return torch.from_numpy(out), one_d

    def _run_encoder(self, features) -> None:
        """Encode the step's new images (same-shaped ones together) into the encoder cache."""
        by_shape: dict[tuple, list] = {}
        for feature in features:
            if feature.hash not in self.encoder_cache:
                by_shape.setdefault((feature.shape, feature.grid_thw), []).append(feature)
        for group in by_shape.values():
            for feature, embeds in zip(group, self.model.embed_multimodal(group)):
                if embeds.shape[0] != feature.length:
                    raise RuntimeError(f"the model made {embeds.shape[0]} embeddings of an image with {feature.length} "
                                       "placeholder tokens")
                self.encoder_cache[feature.hash] = embeds

    def _gather_mm_embeds(self, states, query_start_loc) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, embeddings) of the step's image placeholder tokens, from the encoder cache."""
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for i, state in enumerate(states):
            if not state.mm_features:
                continue
            start = state.num_computed_tokens  # before this step
            end = start + int(query_start_loc[i + 1] - query_start_loc[i])
            for feature in state.mm_features:
                if not feature.overlaps(start, end):
                    continue
                embeds = self.encoder_cache.get(feature.hash)
                if embeds is None:
                    raise RuntimeError(f"request {state.req_id}: the encoder output of image {feature.hash[:12]} is "
                                       "not in the encoder cache (scheduler and runner disagree)")
                lo, hi = max(feature.offset, start), min(feature.end, end)
                first_row = int(query_start_loc[i]) + lo - start
                rows.append(torch.arange(first_row, first_row + hi - lo))
                values.append(embeds[lo - feature.offset : hi - feature.offset])
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(values)

    def lora_stats(self) -> dict[str, int]:
        """Adapter loads into slots, evictions from them, adapters resident now."""
        if self.lora is None:
            return {}
        return {"lora_loads": self.lora.num_loads, "lora_evictions": self.lora.num_evictions,
                "loras_resident": len(self.lora.resident())}

    def _set_lora_slots(self, states, query_start_loc, num_rows: int) -> None:
        """The step's token -> adapter slot map (-1: the base model; padding rows too), or
        None when no request of the step runs an adapter."""
        if self.lora_state is None:
            return
        self.lora_state.token_slots = None
        if not any(s.lora_id for s in states):
            return
        slot_of, failures = self.lora.activate(s.lora_id for s in states)
        slots = torch.full((num_rows,), -1, dtype=torch.int64)
        for state, lo, hi in zip(states, query_start_loc[:-1].tolist(), query_start_loc[1:].tolist()):
            if state.lora_id in failures:
                self._lora_errors[state.req_id] = failures[state.lora_id]
            elif state.lora_id:
                slots[lo:hi] = slot_of[state.lora_id]
        self.lora_state.token_slots = slots.to(self.device)

    def _forward(self) -> EagerForward:
        return self.forward or EagerForward(self.model)

    def _run_model(self, inputs: ModelInputs) -> torch.Tensor:
        """The model's hidden states of the step's real tokens: [num_tokens, hidden]."""
        if inputs.step.mm_embeds is not None or (self.lora_state is not None and self.lora_state.token_slots is not None):
            # steps that carry images or adapters run the model eagerly (compiled and
            # recorded forwards are specialized to token inputs and the base weights)
            return self.model(inputs.input_ids, inputs.positions, inputs.step)[: inputs.num_tokens]
        return self._forward()(inputs.input_ids, inputs.positions, inputs.step)[: inputs.num_tokens]

    def _pool(self, inputs: ModelInputs, hidden: torch.Tensor) -> dict[str, tuple[float, ...]]:
        """Embeddings of the requests whose whole prompt has now been computed."""
        pooled = self.model.pool(hidden, inputs.step)  # [num_seqs, hidden]
        return {
            state.req_id: tuple(pooled[i].float().cpu().tolist())
            for i, state in enumerate(inputs.states)
            if state.num_computed_tokens >= len(state.token_ids)
        }

    def _mask_logits(self, logits: torch.Tensor, sample_ids: list[str], positions: list[int]) -> torch.Tensor:
        """Tokens a grammar forbids at -inf, for the rows of requests under one (structured
        outputs): the row of each request's sampled position (0, or a proposal's)."""
        ids, data, counts = self._grammar
        if not isinstance(data, bytes):  # filled on the scheduler's thread while the model ran
            data = data.result()
        counts = counts or (1,) * len(ids)
        rows = torch.frombuffer(bytearray(data), dtype=torch.int32).view(sum(counts), -1)
        first = dict(zip(ids, np.cumsum((0, *counts[:-1])).tolist()))
        mask = torch.full((len(sample_ids), rows.shape[1]), -1, dtype=torch.int32)
        for row, (rid, position) in enumerate(zip(sample_ids, positions)):
            if rid in first:
                mask[row] = rows[first[rid] + position]
        return self._apply_token_bitmask(logits, mask.to(logits.device))

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
