"""The engine core: scheduler + executor, one `step()` at a time.

Tokens in, tokens out: text, chat templates and stop strings live in the front end
(`output_processor`), so the same core serves `LLM` in-process and `serve` from its own
process.
"""

from __future__ import annotations

import logging
import time

from portaserve.framework.engine.block_manager import BlockManager
from portaserve.framework.engine.request import Request, RequestStatus
from portaserve.framework.engine.scheduler import Scheduler
from portaserve.framework.engine.scheduler_output import EngineCoreOutput
from portaserve.framework.engine.speculative import SpeculativeConfig
from portaserve.framework.engine.startup import EngineSpec, default_num_batched_tokens
from portaserve.framework.errors import InvalidParameterError, invalid
from portaserve.framework.executor.executor import Executor, make_executor
from portaserve.framework.structured.manager import StructuredOutputManager

logger = logging.getLogger("portaserve")


class EngineCore:
    """Owns the scheduler, the block manager and the executor of one engine."""

    def __init__(self, spec: EngineSpec, executor: Executor | None = None) -> None:
        self.spec = spec
        t0 = time.perf_counter()
        self.executor = executor or make_executor(spec)
        num_blocks = self.executor.determine_num_blocks()
        if num_blocks < 1:
            raise ValueError("kv_cache_memory: the KV-cache budget fits no block; raise --kv-cache-memory")
        self.executor.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        config = spec.config
        self.block_manager = BlockManager(num_blocks, spec.plan.block_size, enable_caching=config.enable_prefix_caching and not spec.is_pooling)
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=default_num_batched_tokens(spec),
            max_model_len=spec.max_model_len,
            block_size=spec.plan.block_size,
            enable_chunked_prefill=config.enable_chunked_prefill and not spec.is_pooling,
            scheduling_policy=config.scheduling_policy,
            max_prefill_tokens_with_decodes=spec.plan.prefill_cap_with_decodes,
            block_manager=self.block_manager,
            structured=None if spec.is_pooling else StructuredOutputManager(spec, spec.plan.structured_outputs.name),
            max_loras=config.max_loras,
            speculative=SpeculativeConfig.parse(config.speculative_config) if not spec.is_pooling else None,
        )
        self.weights_version = 0
        self.sleep_level = 0
        self._reference_specs = None  # the serving checkpoint's tensor shapes, read on first update
        self._update_group: dict | None = None
        logger.info(
            "engine ready in %.1fs: %d KV blocks of %d tokens (%d tokens)",
            time.perf_counter() - t0,
            num_blocks,
            spec.plan.block_size,
            num_blocks * spec.plan.block_size,
        )

    def add_request(self, request: Request) -> None:
        if self.sleep_level:
            raise invalid("request", f"the engine is sleeping (level {self.sleep_level}); call wake_up first")
        self.scheduler.add_request(request)

    def add_requests(self, requests: list[Request]) -> None:
        """The sequences of one prompt (its `n` children), checked together, then each added.

        :raises InvalidParameterError: they cannot fit in the KV cache at once, or one of
            them can never be served; none is added then.
        """
        self.scheduler.check_siblings_fit(requests)
        added = []
        try:
            for request in requests:
                self.add_request(request)
                added.append(request.request_id)
        except Exception:
            self.abort_requests(added)
            raise

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.abort_requests(req_ids)

    def finish_requests(self, req_ids: list[str]) -> None:
        """End requests the front end stopped (a stop string matched)."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, and report every request that changed."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            # Aborted requests still need their finish reported (and the runner told).
            return self.scheduler.update_from_output(sched, None)
        out = self.executor.execute_model(sched)
        return self.scheduler.update_from_output(sched, out)

    def stats(self):
        return self.scheduler.stats()

    def lora_stats(self) -> dict[str, int]:
        """Rank 0's adapter counters (framework/lora/manager.py); empty without --enable-lora."""
        return self.executor.call_workers("lora_stats")[0] if self.spec.config.enable_lora else {}

    def reset_prefix_cache(self) -> bool:
        """Drop cached prefixes; False (nothing changed) while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    def check_health(self) -> None:
        self.executor.check_health()

    # ----- live weight updates ---------------------------------------------------------
    # In-flight requests are not interrupted: the callers (core_process, LLMEngine) let the
    # requests already running finish on the old weights and hold new ones back until the
    # update returns; here the engine must be idle. See weight_update.py for the phases.

    def _require_idle(self, what: str) -> None:
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError(f"{what}: requests are still running; let them finish first")

    def _require_weights(self, what: str) -> None:
        if self.sleep_level >= 2:
            raise invalid("weights", f"{what}: the weights are offloaded (sleep level 2); call wake_up first")

    def _reference(self):
        if self._reference_specs is None:
            from portaserve.framework.executor.weight_update import read_checkpoint_specs

            self._reference_specs = read_checkpoint_specs(self.spec.model_path)
        return self._reference_specs

    def _commit_staged(self, results, what: str, started: float) -> dict:
        failed = [(rank, r) for rank, r in enumerate(results) if not r.ok]
        if failed:
            self.executor.call_workers("discard_staged_weights")
            rank, first = failed[0]
            where = f" (rank {rank})" if len(results) > 1 else ""
            logger.warning("%s rejected%s, still serving weights version %d: %s", what, where, self.weights_version, first.error)
            raise InvalidParameterError(first.error_param or "weights", f"{first.error}{where}")
        num_bytes = sum(self.executor.call_workers("commit_staged_weights"))
        self.weights_version += 1
        if not self.scheduler.reset_prefix_cache():
            logger.warning("%s: the prefix cache could not be reset (blocks still held)", what)
        seconds = time.perf_counter() - started
        logger.info(
            "%s: weights version %d (%d tensors, %.1f MiB over all ranks) in %.2fs",
            what, self.weights_version, results[0].num_tensors, num_bytes / 2**20, seconds,
        )
        return {"weights_version": self.weights_version, "num_tensors": results[0].num_tensors, "num_bytes": num_bytes,
                "seconds": seconds}

    def update_weights(self, path: str) -> dict:
        """Reload every weight from checkpoint folder `path` (same architecture and shapes).

        :returns: {"weights_version", "num_tensors", "num_bytes", "seconds"}.
        :raises InvalidParameterError: the folder is missing or does not fit (the old
            weights keep serving).
        """
        from portaserve.framework.executor.weight_update import validate_folder_update

        started = time.perf_counter()
        self._require_idle("update_weights")
        self._require_weights("update_weights")
        validate_folder_update(self._reference(), path, self.spec.hf_config.get("architectures") or ())
        results = self.executor.call_workers("stage_weights_from_folder", str(path))
        return self._commit_staged(results, f"update_weights({str(path)!r})", started)

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 timeout_s: float | None = None) -> dict:
        """Join a trainer's process group: the trainer is rank 0, this engine's rank r is
        `rank_offset + r`. Blocks until every member has joined."""
        from portaserve.framework.interfaces.communicator import DEFAULT_GROUP_TIMEOUT_S

        tp = self.spec.config.tensor_parallel_size
        if not isinstance(master_port, int) or not 1 <= master_port <= 65535:
            raise invalid("master_port", f"must be a port number in 1..65535, got {master_port!r}")
        if not isinstance(rank_offset, int) or rank_offset < 1:
            raise invalid("rank_offset", f"must be >= 1 (rank 0 is the trainer), got {rank_offset!r}")
        if not isinstance(world_size, int) or rank_offset + tp > world_size:
            raise invalid("world_size", f"must be at least rank_offset + tensor_parallel_size = {rank_offset + tp}, "
                          f"got {world_size!r}")
        results = self.executor.call_workers(
            "init_weight_update_group", str(master_address), master_port, rank_offset, world_size,
            float(timeout_s or DEFAULT_GROUP_TIMEOUT_S),
        )
        failed = [r for r in results if not r.ok]
        if failed:
            self.executor.call_workers("destroy_weight_update_group")
            raise InvalidParameterError(failed[0].error_param or "master_address", failed[0].error)
        self._update_group = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                              "world_size": world_size}
        logger.info("joined the weight-update group at %s:%d (ranks %d..%d of %d)", master_address, master_port,
                    rank_offset, rank_offset + tp - 1, world_size)
        return dict(self._update_group)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict:
        """Receive the named tensors from the trainer (rank 0 of the weight-update group),
        broadcast in this order, and swap them in. A rejected update is announced to the
        trainer before any tensor moves (see `TrainerWeightSender`)."""
        from portaserve.framework.executor.weight_update import validate_tensor_specs

        started = time.perf_counter()
        self._require_idle("update_weights_from_distributed")
        if self._update_group is None:
            raise invalid("init_weight_update_group", "no weight-update group: call init_weight_update_group first")
        rejection: InvalidParameterError | None = None
        specs: list = []
        try:
            self._require_weights("update_weights_from_distributed")
            specs = validate_tensor_specs(self._reference(), names, dtypes, shapes, self.spec.plan.torch_dtype)
        except InvalidParameterError as exc:
            rejection = exc
        # every member takes part in the verdict, so the trainer learns of a rejection too
        results = self.executor.call_workers(
            "stage_weights_from_distributed", specs, None if rejection is None else str(rejection)
        )
        if rejection is not None:
            logger.warning("update_weights_from_distributed rejected, still serving weights version %d: %s",
                           self.weights_version, rejection)
            raise rejection
        return self._commit_staged(results, "update_weights_from_distributed", started)

    def destroy_weight_update_group(self) -> None:
        self.executor.call_workers("destroy_weight_update_group")
        self._update_group = None

    def weights_info(self) -> dict:
        """The weights version, the checkpoint, and each rank's parameter bytes."""
        ranks = self.executor.call_workers("weights_info")
        return {"weights_version": self.weights_version, "model_path": self.spec.model_path,
                "sleep_level": self.sleep_level, "ranks": ranks}

    # ----- sleep / wake (RL loops: free the device while the trainer runs) ----------------

    def sleep(self, level: int = 1) -> dict:
        """Level 1 releases the KV cache; level 2 also offloads the weights to host memory.
        Requests are rejected while asleep. Returns the bytes released over all ranks."""
        if level not in (1, 2):
            raise invalid("level", f"must be 1 (KV cache) or 2 (KV cache and weights), got {level!r}")
        self._require_idle("sleep")
        self.scheduler.reset_prefix_cache()  # the cached K/V goes with the KV cache
        per_rank = self.executor.call_workers("sleep", level)
        self.sleep_level = max(self.sleep_level, level)
        out = {
            "level": self.sleep_level,
            "kv_cache_bytes": sum(r["kv_cache_bytes"] for r in per_rank),
            "weights_bytes": sum(r["weights_bytes"] for r in per_rank),
        }
        logger.info("sleep(level=%d): released %.1f MiB of KV cache and offloaded %.1f MiB of weights", level,
                    out["kv_cache_bytes"] / 2**20, out["weights_bytes"] / 2**20)
        return out

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """Restore what `sleep` released: `tags` among "weights" and "kv_cache" (default
        both; waking the weights first lets an update land before the KV cache returns)."""
        tags = list(tags) if tags else ["weights", "kv_cache"]
        unknown = [t for t in tags if t not in ("weights", "kv_cache")]
        if unknown:
            raise invalid("tags", f"unknown tag(s) {unknown}; allowed: 'weights', 'kv_cache'")
        per_rank = self.executor.call_workers("wake_up", tags)
        levels = [info["sleep_level"] for info in self.executor.call_workers("weights_info")]
        self.sleep_level = max(levels)
        out = {
            "sleep_level": self.sleep_level,
            "kv_cache_bytes": sum(r["kv_cache_bytes"] for r in per_rank),
            "weights_bytes": sum(r["weights_bytes"] for r in per_rank),
        }
        logger.info("wake_up(%s): restored %.1f MiB of weights and %.1f MiB of KV cache", ",".join(tags),
                    out["weights_bytes"] / 2**20, out["kv_cache_bytes"] / 2**20)
        return out

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def shutdown(self) -> None:
        self.executor.shutdown()
