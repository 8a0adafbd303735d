"""From an ExecutionPlan and a checkpoint folder to a model ready to run on one rank.

The architecture is looked up by the name the plan chose (never re-selected); layers
get their QuantMethod, attention backends and fused ops from the LayerContext; weights
stream from the safetensors files (or the GGUF file) one tensor at a time and each rank keeps only its
shard. Parameters are created directly on the target device in the plan's dtype, and
checkpoint tensors are converted to it as they are copied in.
"""

from __future__ import annotations

import logging
import os
import time

from typing import Any

import torch

from portaserve.framework.checkpoint import iter_weights, load_hf_config
from portaserve.framework.interfaces import Communicator, ModelArchitecture
from portaserve.framework.layer_context import LayerContext
from portaserve.framework.plan import ExecutionPlan
from portaserve.framework.plugins import PluginRegistry

logger = logging.getLogger("portaserve")


def build_model(
    plan: ExecutionPlan,
    registry: PluginRegistry,
    model_path: str | os.PathLike,
    device: torch.device | str,
    tp_rank: int = 0,
    tp_size: int = 1,
    communicator: Communicator | None = None,
    *,
    progress: bool | None = None,
    lora: Any = None,
) -> ModelArchitecture:
    """Build the plan's architecture for rank `tp_rank` of `tp_size` and load its weights.

    :param progress: show a progress bar while loading (default: on rank 0 only).
    :param lora: a `LoRAState` when the engine serves adapters (the layers allocate their slots).
    :returns: the model in eval mode, parameters in `plan.dtype` on `device`.
    """
    device = torch.device(device)
    if tp_size > 1 and communicator is None:
        raise ValueError(f"tensor_parallel_size {tp_size} needs a communicator (got None)")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is out of range for tensor_parallel_size {tp_size}")
    hf_config = load_hf_config(model_path)
    arch_cls = plan.model_class(registry)
    ctx = LayerContext.from_plan(plan, registry, device, tp_rank, tp_size, communicator)
    if lora is not None:
        modules = arch_cls.lora_modules(hf_config)
        if modules is None:
            from portaserve.framework.errors import UnsupportedError

            raise UnsupportedError(f"enable_lora: {arch_cls.__name__} takes no LoRA adapters")
        lora.bind(ctx)
        lora.modules = frozenset(modules)
        ctx.lora = lora
    start, rss_before = time.perf_counter(), _resident_bytes()
    # Parameters are allocated where they will live; no CPU staging copy of the model.
    with torch.device(device):
        model = arch_cls.build(hf_config, ctx)
    # a GGUF file whose plan keeps it quantized ("gguf" method) loads codes and scales
    keep_quantized = plan.quantization_config.get("quant_method") == "gguf"
    model.load_weights(iter_weights(model_path, progress=(tp_rank == 0) if progress is None else progress,
                                    keep_gguf_quantized=keep_quantized))
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    _release_loading_memory(model_path)
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rss_growth = _resident_bytes() - rss_before
    logger.info(
        "loaded %s (%s, %.1f MiB on rank %d/%d; process RSS +%.1f MiB) in %.2fs",
        plan.model_architecture.name,
        plan.dtype,
        num_bytes / 2**20,
        tp_rank,
        tp_size,
        rss_growth / 2**20,
        time.perf_counter() - start,
    )
    model.load_stats = {"weight_bytes": num_bytes, "rss_growth_bytes": rss_growth}
    return model


def _release_loading_memory(model_path: str | os.PathLike) -> None:
    """Give back what loading used and the model does not keep: a GGUF file's cached
    reader and mapped pages, and the heap pages the checkpoint-layout tensors freed (a
    quantized model loads codes at a byte a weight, then packs them; glibc keeps the
    freed heap pages unless asked)."""
    from portaserve.framework.gguf.file import is_gguf_path, release_gguf

    if is_gguf_path(model_path):
        release_gguf(model_path)
    try:
        import ctypes

        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def _resident_bytes() -> int:
    """This process's resident set size (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
