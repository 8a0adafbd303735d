"""The synchronous, in-process engine: input processor + engine core + output processor.

`LLM` drives it for offline batches; the server runs the same core in its own process
behind an async client instead (see `core_client`).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from portaserve.framework.config import EngineConfig
from portaserve.framework.engine.core import EngineCore
from portaserve.framework.engine.output_processor import OutputProcessor
from portaserve.framework.engine.outputs import EmbeddingRequestOutput, RequestOutput
from portaserve.framework.engine.params import PoolingParams, SamplingParams
from portaserve.framework.engine.processor import InputProcessor
from portaserve.framework.engine.startup import EngineSpec, resolve_engine
from portaserve.framework.errors import invalid

logger = logging.getLogger("portaserve")


def load_tokenizer(spec: EngineSpec):
    if spec.config.skip_tokenizer_init:
        return None
    from portaserve.framework.engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(spec.tokenizer_path)


class LLMEngine:
    def __init__(self, config: EngineConfig, spec: EngineSpec | None = None) -> None:
        self.config = config
        self.spec = spec or resolve_engine(config)
        logger.info("%s", self.spec.plan)
        self.tokenizer = load_tokenizer(self.spec)
        self.processor = InputProcessor(self.spec, self.tokenizer)
        self.core = EngineCore(self.spec)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        # outputs of steps run while draining for a weight update / sleep, for the next step()
        self._drained: list[RequestOutput | EmbeddingRequestOutput] = []

    @property
    def plan(self):
        return self.spec.plan

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
    ) -> None:
        if self.output_processor.has_request(request_id):
            raise invalid("request_id", f"{request_id!r} is already in flight")
        processed = self.processor.process(
            request_id, prompt, params, priority=priority, cache_salt=cache_salt, arrival_time=arrival_time,
            lora_request=lora_request,
        )
        self.output_processor.add_request(processed)
        try:
            self.core.add_requests(list(processed.children))
        except Exception:
            self.core.abort_requests([c.request_id for c in processed.children])
            self.output_processor.abort_request(request_id)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            children = self.output_processor.child_ids(rid)
            if children:
                self.core.abort_requests(children)
                self.output_processor.abort_request(rid)

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        if self._drained:
            outputs, self._drained = self._drained, []
            return outputs
        return self._step()

    def _step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        core_outputs = self.core.step()
        outputs, to_finish = self.output_processor.process_outputs(core_outputs)
        if to_finish:
            self.core.finish_requests(to_finish)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or bool(self.output_processor.parents) or bool(self._drained)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def stats(self):
        return self.core.stats()

    # ----- weight updates and sleep: the running requests finish first (old weights) -----

    def _drain(self) -> None:
        while self.core.has_unfinished_requests():
            self._drained.extend(self._step())

    def _after_update(self, result: dict) -> dict:
        self.output_processor.weights_version = self.core.weights_version
        return result

    @property
    def weights_version(self) -> int:
        return self.core.weights_version

    def update_weights(self, path: str) -> dict:
        self._drain()
        return self._after_update(self.core.update_weights(path))

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 timeout_s: float | None = None) -> dict:
        return self.core.init_weight_update_group(master_address, master_port, rank_offset, world_size, timeout_s)

    def update_weights_from_distributed(self, names, dtypes, shapes) -> dict:
        self._drain()
        return self._after_update(self.core.update_weights_from_distributed(names, dtypes, shapes))

    def destroy_weight_update_group(self) -> None:
        self.core.destroy_weight_update_group()

    def sleep(self, level: int = 1) -> dict:
        self._drain()
        return self.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> dict:
        return self.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()
