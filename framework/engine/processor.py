"""Front-end input processing: prompts to validated engine Requests.

Tokenizes text prompts, checks every limit that needs the model (prompt length,
max_tokens, vocabulary, logprobs), resolves max_tokens and stop token ids, and fans a
request with `n > 1` out into n child Requests that share the prompt (and, through the
prefix cache, its KV blocks).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from portaserve.framework.engine.params import PoolingParams, SamplingParams
from portaserve.framework.engine.request import Request
from portaserve.framework.errors import InvalidParameterError, invalid

if TYPE_CHECKING:  # the plan (and torch) are not needed to validate requests
    from portaserve.framework.engine.startup import EngineSpec

#: guards the lazy build of Processor.mm_processor (request threads race for it)
_MM_PROCESSOR_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    """A user request after validation: its children go to the engine core."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    children: tuple[Request, ...]
    arrival_time: float


#: images per prompt when --limit-mm-per-prompt does not say
DEFAULT_IMAGE_LIMIT = 8


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{parent_id}#{index}"


class InputProcessor:
    def __init__(self, spec: EngineSpec, tokenizer: Any | None) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.eos_token_ids: frozenset[int] = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        gen_eos = spec.hf_config.get("eos_token_id")
        if tokenizer is None and gen_eos is not None:
            self.eos_token_ids = frozenset(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.vocab_size = spec.vocab_size

    @property
    def mm_processor(self):
        """The model's ImagePromptProcessor (vision-language models), else None. Built on
        first use, once: the server's request threads ask for it concurrently, and none may
        see it before it is built (a first burst of image requests was refused as "not a
        vision-language model" while another thread was still building it)."""
        with _MM_PROCESSOR_LOCK:
            if not hasattr(self, "_mm_processor"):
                processor = None
                if "vision_config" in self.spec.hf_config:
                    from portaserve.framework.plugins import get_registry

                    cls = self.spec.plan.model_class(get_registry())
                    factory = getattr(cls, "multimodal_processor", None)
                    if factory is not None:
                        processor = factory(self.spec.hf_config, self.spec.model_path)
                self._mm_processor = processor
        return self._mm_processor

    def _images(self, prompt: Any) -> list:
        """The images of a dict prompt's `multi_modal_data`, checked against the limits."""
        if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
            return []
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict):
            raise invalid("multi_modal_data", f"must be a dict of modality -> item(s), got {type(data).__name__}")
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise invalid("multi_modal_data", f"modalities {unknown} are not supported; supported: ['image']")
        images = data.get("image")
        images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
        if not images:
            return []
        if self.mm_processor is None:
            raise invalid("multi_modal_data", "this model does not take images (it is not a vision-language model)")
        limit = self.image_limit
        if len(images) > limit:
            raise invalid("multi_modal_data", f"{len(images)} images exceed the limit of {limit} per prompt (--limit-mm-per-prompt)")
        from PIL import Image

        for k, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise invalid(f"multi_modal_data.image[{k}]", f"must be a PIL.Image.Image, got {type(image).__name__}")
        return images

    def _check_constraint(self, params: SamplingParams) -> None:
        """The backend's own validation of the constraint: an invalid schema, regex or
        grammar is a 400 here, before the engine compiles anything."""
        from portaserve.framework.plugins import get_registry
        from portaserve.framework.structured.params import check_with_backend

        choice = self.spec.plan.structured_outputs
        name = params.structured_outputs.field_name
        if choice.name == "none":
            raise invalid(name, f"structured outputs are unavailable: {choice.reason}")
        check_with_backend(params.structured_outputs, get_registry().get("structured_output_backends", choice.name))

    def _check_features(self, features, token_ids: list[int]) -> tuple:
        from portaserve.framework.multimodal.inputs import MultiModalFeature

        mm = self.mm_processor
        for f in features:
            if (mm is None or not isinstance(f, MultiModalFeature) or f.offset < 0 or f.end > len(token_ids)
                    or any(t != mm.placeholder_token_id for t in token_ids[f.offset : f.end])):
                raise invalid("multi_modal_features", "do not match the prompt's image placeholders")
        return tuple(features)

    @property
    def image_limit(self) -> int:
        limits = self.spec.config.limit_mm_per_prompt or {}
        return int(limits.get("image", DEFAULT_IMAGE_LIMIT))

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise invalid("prompt", "this engine was started without a tokenizer; pass token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def process(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | PoolingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: Any = None,
    ) -> ProcessedRequest:
        text, token_ids = self._prompt_tokens(prompt)
        if not token_ids:
            raise invalid("prompt", "must not be empty")
        mm_features: tuple = ()
        images = self._images(prompt)
        if isinstance(prompt, dict) and prompt.get("multi_modal_features"):
            # the server expanded the placeholders itself (it needed the count for usage)
            mm_features = self._check_features(prompt["multi_modal_features"], token_ids)
        elif images:
            token_ids, features = self.mm_processor.expand(token_ids, images)
            mm_features = tuple(features)
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise invalid("prompt", f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if isinstance(params, PoolingParams):
            if not self.spec.is_pooling:
                raise invalid("model", "this model generates text; embeddings need an embedding model")
            if len(token_ids) > self.spec.max_model_len:
                raise InvalidParameterError(
                    "input", f"input: {len(token_ids)} tokens exceed max_model_len {self.spec.max_model_len}"
                )
            child = Request(request_id, token_ids, pooling_params=params, arrival_time=arrival, priority=priority, max_tokens=1)
            return ProcessedRequest(request_id, text, token_ids, params, (child,), arrival)
        if self.spec.is_pooling:
            raise invalid("model", "this is an embedding model; it cannot generate text (use embeddings)")
        params.validate_for_model(len(token_ids), self.spec.max_model_len, self.vocab_size, self.spec.config.max_logprobs)
        if params.structured_outputs is not None:
            self._check_constraint(params)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.spec.max_model_len - len(token_ids)
        children = []
        for i in range(params.n):
            child_params = params.clone() if params.n > 1 else params
            if params.n > 1:
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = params.seed + i  # each sample differs, all reproducible
            stop_ids = set(child_params.stop_token_ids or ())
            if not child_params.ignore_eos:
                stop_ids |= self.eos_token_ids
            child_params.all_stop_token_ids = stop_ids
            children.append(
                Request(
                    child_request_id(request_id, i, params.n),
                    list(token_ids),
                    sampling_params=child_params,
                    eos_token_ids=frozenset() if child_params.ignore_eos else self.eos_token_ids,
                    arrival_time=arrival,
                    priority=priority,
                    cache_salt=cache_salt,
                    max_tokens=max_tokens,
                    mm_features=mm_features,
                    lora_request=self._check_lora(lora_request),
                )
            )
        return ProcessedRequest(request_id, text, token_ids, params, tuple(children), arrival)

    def _check_lora(self, lora_request: Any) -> Any:
        if lora_request is None:
            return None
        if not self.spec.config.enable_lora:
            raise invalid("lora_request", "this engine does not serve LoRA adapters; start it with enable_lora=True "
                                          "(--enable-lora)")
        from portaserve.framework.lora.peft_adapter import load_peft_adapter
        from portaserve.framework.lora.request import LoRARequest

        if not isinstance(lora_request, LoRARequest):
            raise invalid("lora_request", f"must be a LoRARequest, got {type(lora_request).__name__}")
        key = (lora_request.lora_int_id, lora_request.lora_path)
        checked = self.__dict__.setdefault("_loras_checked", {})
        if key not in checked:
            # the whole adapter is read and checked here, so a bad one is this request's
            # 400 and never reaches the workers
            load_peft_adapter(lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path,
                              self.spec.config.max_lora_rank, self.lora_shapes())
            if len(checked) >= 1024:
                checked.clear()
            checked[key] = True
        return lora_request

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """The model's adaptable modules (ModelArchitecture.lora_modules)."""
        if not hasattr(self, "_lora_shapes"):
            from portaserve.framework.plugins import get_registry

            shapes = self.spec.plan.model_class(get_registry()).lora_modules(self.spec.hf_config)
            if shapes is None:
                raise invalid("lora_request", f"{self.spec.plan.model_architecture.name} takes no LoRA adapters")
            self._lora_shapes = shapes
        return self._lora_shapes

    def _prompt_tokens(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenize(prompt["prompt"])
            raise invalid("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, [int(t) for t in prompt]
        raise invalid("prompt", f"must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
