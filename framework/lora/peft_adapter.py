"""Reading an adapter in PEFT's format, checked against the model before anything is loaded.

A folder holds `adapter_config.json` and `adapter_model.safetensors` (or `.bin`, refused:
pickles are not loaded). Supported: LoRA on the attention and MLP projections
(`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`, whether
the model fuses them or not), any rank up to `--max-lora-rank`, `lora_alpha` scaling
(alpha / r, or alpha / sqrt(r) with `use_rslora`). Refused with an error naming what:
DoRA, `modules_to_save`, adapters on embeddings or the LM head, LoRA biases, any other
module, and tensors whose shapes do not fit the model. The scaling is folded into B.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from portaserve.framework.errors import InvalidParameterError

#: the projections an adapter may target (checkpoint names)
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")


class LoRALoadError(InvalidParameterError):
    """An adapter that cannot be served (a 400 naming the adapter and the reason)."""

    def __init__(self, message: str) -> None:
        super().__init__("lora_path", message)


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights on the host: checkpoint module name -> (A [r, in], B [out, r] * scaling)."""

    name: str
    int_id: int
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise LoRALoadError(f"{folder}: no adapter_config.json (a PEFT adapter folder holds adapter_config.json "
                            "and adapter_model.safetensors)")
    try:
        config = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise LoRALoadError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoRALoadError(f"{path}: must hold a JSON object")
    return config


def check_config(config: dict, where: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a LoRA config, or a LoRALoadError saying what is not supported."""
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoRALoadError(f"{where}: peft_type {kind!r} is not supported; only LORA")
    if config.get("use_dora"):
        raise LoRALoadError(f"{where}: DoRA adapters (use_dora) are not supported")
    if config.get("modules_to_save"):
        raise LoRALoadError(f"{where}: modules_to_save ({config['modules_to_save']}) is not supported: only LoRA "
                            "deltas on the projections")
    if config.get("bias", "none") != "none":
        raise LoRALoadError(f"{where}: LoRA biases (bias={config['bias']!r}) are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoRALoadError(f"{where}: per-module ranks or alphas (rank_pattern / alpha_pattern) are not supported")
    rank, alpha = config.get("r", 8), config.get("lora_alpha", config.get("r", 8))
    if not isinstance(rank, int) or isinstance(rank, bool) or not isinstance(alpha, (int, float)):
        raise LoRALoadError(f"{where}: r must be an integer and lora_alpha a number, got {rank!r} and {alpha!r}")
    if not 1 <= rank <= max_rank:
        raise LoRALoadError(f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = float(alpha)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling


def load_peft_adapter(name: str, int_id: int, path: str, max_rank: int,
                      shapes: dict[str, tuple[int, int]]) -> LoRAAdapter:
    """Read and check the adapter at `path` against the model's projections `shapes`
    (checkpoint module name -> (in, out), full sizes)."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRALoadError(f"{path}: not a folder")
    where = f"adapter {name!r} ({path})"
    rank, scaling = check_config(_config(folder), where, max_rank)
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoRALoadError(f"{where}: no adapter_model.safetensors (.bin pickles are not loaded)")
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001 - a corrupt or truncated file
        raise LoRALoadError(f"{where}: adapter_model.safetensors cannot be read ({exc})") from None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRALoadError(f"{where}: tensor {key!r} is not a LoRA A/B weight (embeddings, biases and "
                                "modules_to_save are not supported)")
        module, ab = match.group("module"), match.group("ab")
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in SUPPORTED_MODULES:
            raise LoRALoadError(f"{where}: tensor {key!r} targets {leaf!r}; supported: {', '.join(SUPPORTED_MODULES)}")
        if module not in shapes:
            raise LoRALoadError(f"{where}: tensor {key!r}: this model has no module {module!r} (an adapter for "
                                "another architecture?)")
        parts.setdefault(module, {})[ab] = tensor
    weights = {}
    for module, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoRALoadError(f"{where}: {module} has lora_{'A' if 'A' in ab else 'B'} only")
        a, b = ab["A"], ab["B"]
        d_in, d_out = shapes[module]
        if tuple(a.shape) != (rank, d_in) or tuple(b.shape) != (d_out, rank):
            raise LoRALoadError(f"{where}: {module}.lora_A / lora_B have shapes {tuple(a.shape)} / {tuple(b.shape)}, "
                                f"expected ({rank}, {d_in}) / ({d_out}, {rank}) for this model and rank {rank}")
        # copies: safetensors maps the file, and a file replaced under a mapping faults
        weights[module] = (a.to(torch.float32, copy=True).contiguous(), (b.float() * scaling).contiguous())
    if not weights:
        raise LoRALoadError(f"{where}: holds no LoRA weights")
    return LoRAAdapter(name, int_id, rank, weights)
