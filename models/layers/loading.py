"""Mapping checkpoint tensors (HF names) onto a model's parameters, with bookkeeping.

Fused parameters (qkv_proj, gate_up_proj) take several checkpoint tensors, one per
shard; the loader routes each tensor to its parameter's `weight_loader` with the shard
id, and at the end reports every checkpoint tensor it could not place and every
parameter (or shard of one) the checkpoint did not provide, as one clear error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from portaserve.framework.errors import invalid

from .linear import MergedColumnParallelLinear, QKVParallelLinear

#: (fused parameter part, checkpoint part, shard id): `...q_proj.weight` -> `...qkv_proj.weight`, shard "q"
StackedParams = Sequence[tuple[str, str, object]]

LLAMA_STACKED: StackedParams = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a replicated parameter whole (shapes must match; dtype converts)."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def _shards_of(module: nn.Module) -> tuple:
    if isinstance(module, QKVParallelLinear):
        return ("q", "k", "v")
    if isinstance(module, MergedColumnParallelLinear):
        return tuple(range(len(module.output_sizes)))
    return (None,)


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedParams = (),
    rename: Callable[[str], str | None] | None = None,
) -> set[str]:
    """Load `weights` into `model`; returns the checkpoint names consumed.

    :param rename: maps a checkpoint name to the model's name, or to None to skip the
        tensor on purpose (buffers older checkpoints saved, unused heads).
    :raises InvalidParameterError: names that match nothing, or parameters left unloaded.
    """
    params: dict[str, nn.Parameter] = dict(model.named_parameters())
    # every parameter, and for fused ones every shard, must be filled exactly once
    expected: dict[str, tuple] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue  # tied: the same tensor under a second name
            seen.add(id(param))
            full = f"{module_name}.{pname}" if module_name else pname
            # a tensor a QuantMethod derived after loading (online int8's scales) is not
            # the checkpoint's to fill
            if full in params and not getattr(param, "derived_after_loading", False):
                expected[full] = _shards_of(module)
    filled: set[tuple[str, object]] = set()
    consumed: set[str] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name) if rename is not None else ckpt_name
        if name is None:
            consumed.add(ckpt_name)
            continue
        target, shard = name, None
        for fused_part, ckpt_part, shard_id in stacked:
            marker = f".{ckpt_part}."
            if marker in f".{name}":
                target = f".{name}".replace(marker, f".{fused_part}.", 1)[1:]
                shard = shard_id
                break
        param = params.get(target)
        if param is None:
            unexpected.append(ckpt_name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except ValueError as exc:
            raise invalid("model", f"checkpoint tensor {ckpt_name!r} does not fit parameter {target!r}: {exc}") from None
        if shard is None:
            filled.update((target, s) for s in expected.get(target, (None,)))
        else:
            filled.add((target, shard))
        consumed.add(ckpt_name)
    missing = sorted(
        f"{name}" + (f" ({shard})" if shard is not None else "")
        for name, shards in expected.items()
        for shard in shards
        if (name, shard) not in filled
    )
    if unexpected or missing:
        parts = []
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensor(s): {_few(unexpected)}")
        if missing:
            parts.append(f"{len(missing)} missing parameter(s): {_few(missing)}")
        raise invalid("model", f"checkpoint does not match {type(model).__name__}: " + "; ".join(parts))
    return consumed


def _few(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
