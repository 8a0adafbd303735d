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
from portaserve.framework.engine.startup import EngineSpec, default_num_batched_tokens
from portaserve.framework.executor.executor import Executor, make_executor

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
        self.block_manager = BlockManager(num_blocks, config.block_size, enable_caching=config.enable_prefix_caching and not spec.is_pooling)
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=default_num_batched_tokens(spec),
            max_model_len=spec.max_model_len,
            block_size=config.block_size,
            enable_chunked_prefill=config.enable_chunked_prefill and not spec.is_pooling,
            scheduling_policy=config.scheduling_policy,
            block_manager=self.block_manager,
        )
        self.weights_version = 0
        logger.info(
            "engine ready in %.1fs: %d KV blocks of %d tokens (%d tokens)",
            time.perf_counter() - t0,
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
        )

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

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

    def shutdown(self) -> None:
        self.executor.shutdown()
