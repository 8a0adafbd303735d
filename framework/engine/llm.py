"""`from portaserve import LLM`: the offline Python API, named and behaving like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from portaserve.framework.config import EngineConfig
from portaserve.framework.engine.chat import chat_image_urls, without_image_data
from portaserve.framework.engine.llm_engine import LLMEngine
from portaserve.framework.engine.outputs import EmbeddingRequestOutput, RequestOutput
from portaserve.framework.engine.params import PoolingParams, RequestOutputKind, SamplingParams
from portaserve.framework.errors import invalid

# generation_config.json keys that become default SamplingParams (vLLM's behaviour)
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_chat_image(ref, where: str):
    """An offline chat's image part: a PIL image as given, or a data: URL decoded (the
    offline API fetches nothing and reads no files; pass PIL images for those)."""
    from portaserve.framework.multimodal.media import MediaPolicy, load_image

    if isinstance(ref, str):
        return load_image(ref, MediaPolicy.create(), where)
    return ref


class LLM:
    """A model loaded for offline generation, chat and embeddings.

    >>> llm = LLM()  # the random-weight demo checkpoint; pass a folder or hub id
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        config = EngineConfig.create(
            model=model,
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            **kwargs,
        )
        self.llm_engine = LLMEngine(config)

    # ----- helpers ---------------------------------------------------------------------

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def plan(self):
        """The ExecutionPlan this engine runs (platform, backends, and why)."""
        return self.llm_engine.plan

    def get_default_sampling_params(self) -> SamplingParams:
        from portaserve.framework.checkpoint import load_generation_config

        gen = load_generation_config(self.llm_engine.spec.model_path) or {}
        kwargs = {ours: gen[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if gen.get(theirs) is not None}
        if gen.get("do_sample") is False:
            kwargs["temperature"] = 0.0
        return SamplingParams(**{k: v for k, v in kwargs.items() if k != "max_tokens"})

    def _run(self, prompts: list[Any], params: list[SamplingParams | PoolingParams], use_tqdm: bool,
             priority: list[int] | None, loras: list[Any] | None = None):
        engine = self.llm_engine
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            rid = engine.next_request_id()
            engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0,
                               lora_request=loras[i] if loras else None)
            ids.append(rid)
        results: dict[str, Any] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request([r for r in ids if r not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in ids]

    # ----- public API ------------------------------------------------------------------

    def generate(
        self,
        prompts: str | Sequence[Any],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Complete each prompt: text, token ids, or a dict {"prompt": ...} / {"prompt_token_ids":
        [...]}, with "multi_modal_data": {"image": PIL image or list} for vision-language models.

        :param lora_request: a `LoRARequest` for every prompt, or a list with one per prompt
            (None entries run the base model); needs `LLM(enable_lora=True)`."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise invalid("lora_request", f"got {len(loras)} for {len(prompts)} prompts")
        return self._run(prompts, params, use_tqdm, priority, loras)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise invalid("messages", "chat needs a tokenizer (the engine was started with skip_tokenizer_init)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            ids = tokenizer.apply_chat_template(
                without_image_data(conv),
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                tokenize=True,
            )
            images = [load_chat_image(ref, where) for ref, where in chat_image_urls(conv)]
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else
                           {"prompt_token_ids": ids})
        params = self._params_list(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm, None)

    def embed(
        self,
        prompts: str | Sequence[Any],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embeddings of each prompt, with the pooling the model folder declares."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        params = [pooling_params or PoolingParams() for _ in prompts]
        return self._run(prompts, params, use_tqdm, None)

    def _params_list(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            base = self.get_default_sampling_params()
            params = [base.clone() for _ in range(count)]
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params.clone() for _ in range(count)]
        else:
            params = [p.clone() for p in sampling_params]
            if len(params) != count:
                raise invalid("sampling_params", f"got {len(params)} for {count} prompts")
        for p in params:
            p.output_kind = RequestOutputKind.FINAL_ONLY
        return params

    # ----- RL loops: live weight updates, sleep / wake -----------------------------------
    # Requests still running when one of these is called finish on the old weights first.

    @property
    def weights_version(self) -> int:
        """0 at start, +1 per successful weight update (also in RequestOutput.weights_version)."""
        return self.llm_engine.weights_version

    def update_weights(self, path: str) -> dict:
        """Reload the weights from checkpoint folder `path` (same architecture and shapes)
        without a restart; the prefix cache is reset. A folder that does not fit is
        rejected with an error naming the tensor, and the old weights keep serving.

        :returns: {"weights_version", "num_tensors", "num_bytes", "seconds"}.
        """
        return self.llm_engine.update_weights(path)

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 timeout_s: float | None = None) -> dict:
        """Join a trainer's process group (the trainer is rank 0; engine rank r is
        `rank_offset + r`). Blocks until the trainer (a `TrainerWeightSender`) joins too."""
        return self.llm_engine.init_weight_update_group(master_address, master_port, rank_offset, world_size, timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list[list[int]]) -> dict:
        """Receive these full tensors (checkpoint names, the engine's dtype, full shapes) from
        the trainer's broadcast, in this order, and swap them in."""
        return self.llm_engine.update_weights_from_distributed(names, dtypes, shapes)

    def destroy_weight_update_group(self) -> None:
        self.llm_engine.destroy_weight_update_group()

    def sleep(self, level: int = 1) -> dict:
        """Free device memory: level 1 the KV cache, level 2 also the weights (kept in host
        memory). Generating while asleep raises an error. Returns the bytes released."""
        return self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> dict:
        """Undo `sleep` (`tags`: "weights" and/or "kv_cache"; default both); returns the bytes restored."""
        return self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __del__(self) -> None:
        try:
            self.llm_engine.shutdown()
        except Exception:
            pass
