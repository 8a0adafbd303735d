"""From a validated EngineConfig to everything workers need, before any weights load.

Order matters for error messages: plugins, then the platform, then the checkpoint's
config.json, then the ExecutionPlan; a request the platform cannot serve fails in the
plan with what is supported instead, before a single tensor is read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from portaserve.framework.checkpoint import (
    DEFAULT_MODEL_INSTALL,
    DEFAULT_MODEL_NAME,
    default_model_file,
    ensure_demo_checkpoint,
    load_hf_config,
    resolve_model_path,
)
from portaserve.framework.config import EngineConfig
from portaserve.framework.errors import InvalidParameterError, UnsupportedError
from portaserve.framework.plan import ExecutionPlan, resolve_plan
from portaserve.framework.plugins import PluginRegistry, get_registry
from portaserve.framework.selection import choose_platform

logger = logging.getLogger("portaserve")


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """The resolved, picklable description of one engine (sent to every worker)."""

    config: EngineConfig
    plan: ExecutionPlan
    model_path: str
    tokenizer_path: str
    hf_config: dict[str, Any]
    max_model_len: int
    is_pooling: bool
    is_demo: bool
    served_model_name: str
    # speculative decoding's draft model (executor/draft_model.py): its own resolved spec,
    # on the same platform, block size and context length as this one
    draft: "EngineSpec | None" = None

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.get("vocab_size", 0))


def resolve_engine(config: EngineConfig, registry: PluginRegistry | None = None) -> EngineSpec:
    """Resolve plugins, platform, checkpoint and plan for `config`."""
    if config.nnodes > 1:  # no default secret: refuse to start before anything loads
        from portaserve.framework.executor.multinode import cluster_key

        cluster_key()
    registry = registry or get_registry(strict=config.strict_plugins or None)
    model_path, default_name = _model_location(config)
    hf_config = load_hf_config(model_path)

    def can_serve(candidate) -> str | None:
        try:
            resolve_plan(config, registry, candidate, hf_config)
        except UnsupportedError as exc:
            return str(exc)
        return None

    # None: PORTASERVE_STRICT_PLUGINS decides
    choice = choose_platform(registry, config.device, strict=config.strict_plugins or None, can_serve=can_serve)
    plan = resolve_plan(config, registry, choice, hf_config)
    arch = plan.model_class(registry)
    limit, source = arch.max_model_len(hf_config), "max_position_embeddings"
    st_limit = hf_config.get("portaserve_max_seq_length")
    if st_limit and st_limit < limit:
        limit, source = int(st_limit), "sentence_bert_config.json max_seq_length"
    max_model_len = config.max_model_len or limit
    if max_model_len > limit:
        raise InvalidParameterError(
            "max_model_len",
            f"max_model_len: {max_model_len} exceeds the model's limit of {limit} tokens ({source})",
        )
    tokenizer_path = resolve_model_path(config.tokenizer, config.revision) if config.tokenizer else model_path
    is_demo = bool(hf_config.get("portaserve_demo"))
    if is_demo:
        logger.warning("no model given: serving the demo checkpoint at %s (RANDOM WEIGHTS, output is gibberish)", model_path)
    name = config.served_model_name or default_name
    logger.info("serving %s from %s", name, model_path)
    is_pooling = bool(getattr(arch, "is_pooling", False))
    # an embedding model does not decode: speculative_config does not apply (as in the core)
    draft = None if is_pooling else _resolve_draft(config, registry, plan, hf_config, int(max_model_len))
    return EngineSpec(
        config=config,
        plan=plan,
        model_path=str(model_path),
        tokenizer_path=str(tokenizer_path),
        hf_config=dict(hf_config),
        max_model_len=int(max_model_len),
        is_pooling=is_pooling,
        is_demo=is_demo,
        served_model_name=name,
        draft=draft,
    )


def _resolve_draft(config: EngineConfig, registry: PluginRegistry, plan: ExecutionPlan, hf_config: dict,
                   max_model_len: int) -> EngineSpec | None:
    """The draft model's spec when `speculative_config` names one: resolved like the
    target, pinned to the target's platform, block size (the two share block tables) and
    context length, and refused unless its vocabulary is the target's."""
    spec_config = config.speculative_config or {}
    if spec_config.get("model") is None:
        return None
    draft_config = config.model_copy(update={
        "model": spec_config["model"], "gguf_file": spec_config.get("gguf_file"), "tokenizer": None, "revision": None,
        "served_model_name": None, "speculative_config": None, "enable_lora": False, "logits_processors": None,
        "quantization": None, "device": plan.platform.name, "block_size": plan.block_size,
        "max_model_len": max_model_len, "nnodes": 1})
    try:
        draft = resolve_engine(draft_config, registry)
    except (InvalidParameterError, UnsupportedError, OSError, ValueError) as exc:
        raise InvalidParameterError("speculative_config", f"speculative_config.model: {exc}") from None
    if draft.is_pooling or "vision_config" in draft.hf_config:
        raise InvalidParameterError("speculative_config", "speculative_config.model: the draft must be a text "
                                                          "decoder (not an embedding or vision-language model)")
    # a draft of the same family may pad its embedding rows less (Qwen2.5-0.5B: 151936, 7B: 152064);
    # a larger one could propose ids the target does not have
    if not 0 < draft.vocab_size <= int(hf_config.get("vocab_size", 0)):
        raise InvalidParameterError(
            "speculative_config", f"speculative_config.model: the draft's vocabulary ({draft.vocab_size} tokens) is "
                                  f"larger than the target's ({hf_config.get('vocab_size')}); a draft must share the "
                                  "target's tokenizer")
    logger.info("speculative decoding: draft model %s (%s)", draft.model_path, draft.plan.model_architecture.name)
    return draft


def _model_location(config: EngineConfig) -> tuple[Path, str]:
    """The model's folder or GGUF file, and the name it is served under by default."""
    if config.model is not None:
        return resolve_model_path(config.model, config.revision, config.gguf_file), config.model
    default = default_model_file()
    if default is not None:
        logger.info("no model given: serving the default model %s (%s)", DEFAULT_MODEL_NAME, default)
        return default, DEFAULT_MODEL_NAME
    logger.warning(
        "no model given and the default model (%s) is not installed: serving the random-weight demo checkpoint; "
        "get the real one with `%s`", DEFAULT_MODEL_NAME, DEFAULT_MODEL_INSTALL,
    )
    return ensure_demo_checkpoint(), "portaserve-demo"


def default_num_batched_tokens(spec: EngineSpec) -> int:
    """Token budget per step when the user gives none."""
    if spec.config.max_num_batched_tokens is not None:
        return spec.config.max_num_batched_tokens
    if spec.is_pooling:
        # encoders attend bidirectionally: a prompt is never split across steps
        return max(spec.max_model_len, 2048)
    return 2048 if spec.config.enable_chunked_prefill else max(spec.max_model_len, 2048)
