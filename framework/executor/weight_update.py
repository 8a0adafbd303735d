"""Live weight updates: validate, stage, then commit — never a half-updated model.

An update arrives as (checkpoint name, full tensor) pairs, from a checkpoint folder or
broadcast by a trainer over a collective. It goes through three phases:

1. **validate** (driver, metadata only): every name must be a tensor of the checkpoint the
   engine started from, with the same shape; a trainer's tensors must also have the
   engine's dtype. Nothing is read or received yet, so a rejection costs nothing.
2. **stage** (every rank): the model's own `load_weights` maps names onto parameters
   (fused q/k/v, gate/up, tied embeddings) and each parameter's `weight_loader` cuts
   this rank's shard — but into a *copy* of the parameter, never the live one.
3. **commit** (every rank, only when every rank staged without error): copy the staged
   tensors into the live parameters and run each layer's `process_weights_after_loading`.
   A parameter its QuantMethod quantized or repacked is staged in the checkpoint's layout
   (`QuantMethod.checkpoint_layout`: int8 dequantized, oneDNN unpacked) and processed
   again on commit, so a quantized engine takes float updates like an unquantized one.
   Otherwise every rank discards its copies and the old weights keep serving.

Staging holds a second copy of the parameters an update changes until it commits.

A trainer's tensors arrive over a collective group: `weight_transfer` holds both ends
of that exchange (`receive_weights` here, `TrainerWeightSender` on the trainer).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from portaserve.framework.errors import InvalidParameterError, invalid

# safetensors header dtype codes -> torch dtypes
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
    "F8_E5M2": getattr(torch, "float8_e5m2", None),
}


# ----- metadata and validation ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape and dtype of one full (unsharded) checkpoint tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: a dtype torch does not know


def read_checkpoint_specs(folder: str | os.PathLike) -> dict[str, TensorSpec]:
    """Name -> TensorSpec of every tensor in the folder's safetensors files, from their
    headers alone (no tensor data is read). For a GGUF file: its tensors under their HF
    names, as the floats they load as."""
    from portaserve.framework.checkpoint import safetensors_files
    from portaserve.framework.gguf import is_gguf_path, open_gguf

    if is_gguf_path(folder):
        from portaserve.framework.gguf.weights import hf_tensor_name

        gguf = open_gguf(folder)
        return {hf_tensor_name(gguf.architecture, t.name): TensorSpec(t.shape, torch.float32) for t in gguf.tensors}
    specs: dict[str, TensorSpec] = {}
    for file in safetensors_files(folder):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            specs[name] = TensorSpec(tuple(int(d) for d in entry["shape"]), _SAFETENSORS_DTYPES.get(entry["dtype"]))
    return specs


def parse_dtype(value: str | torch.dtype, where: str) -> torch.dtype:
    """'float32', 'torch.bfloat16' or a torch.dtype -> the torch.dtype."""
    if isinstance(value, torch.dtype):
        return value
    text = str(value).strip().removeprefix("torch.")
    dtype = getattr(torch, text, None)
    if not isinstance(dtype, torch.dtype):
        raise invalid("dtypes", f"{where}: {value!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return dtype


def validate_folder_update(reference: Mapping[str, TensorSpec], folder: str | os.PathLike, architectures: Sequence[str]) -> int:
    """Check a checkpoint folder against the serving checkpoint before anything loads.

    :returns: the number of tensors the folder holds.
    :raises InvalidParameterError: a missing folder, another architecture, a tensor name
        the serving checkpoint does not have, a different shape, a non-float tensor where
        a float one is served.
    """
    from portaserve.framework.checkpoint import load_hf_config

    path = Path(folder)
    if not path.is_dir():
        raise invalid("path", f"{str(folder)!r} is not a folder")
    config = load_hf_config(path)
    theirs = list(config.get("architectures") or ())
    if architectures and theirs and list(architectures) != theirs:
        raise invalid("path", f"{str(folder)!r} holds a {theirs} checkpoint; this engine serves {list(architectures)}")
    specs = read_checkpoint_specs(path)
    problems = []
    for name, spec in specs.items():
        ref = reference.get(name)
        if ref is None:
            problems.append(f"unknown tensor {name!r} (not in the serving checkpoint)")
        elif spec.shape != ref.shape:
            problems.append(f"tensor {name!r} has shape {list(spec.shape)}, the serving model expects {list(ref.shape)}")
        elif ref.dtype is not None and spec.dtype is not None and ref.dtype.is_floating_point and not spec.dtype.is_floating_point:
            problems.append(f"tensor {name!r} has dtype {spec.dtype}, the serving model expects a floating-point tensor")
    if problems:
        raise invalid("path", f"{str(folder)!r} does not fit the serving model: " + _few(problems))
    return len(specs)


def validate_tensor_specs(
    reference: Mapping[str, TensorSpec],
    names: Sequence[str],
    dtypes: Sequence[str | torch.dtype],
    shapes: Sequence[Sequence[int]],
    model_dtype: torch.dtype,
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Check a trainer's announced tensors; returns (name, dtype, shape) triples.

    :raises InvalidParameterError: lists of different lengths, an unknown name, a repeated
        name, a shape unlike the serving checkpoint's, a dtype other than the engine's.
    """
    names, dtypes, shapes = list(names), list(dtypes), list(shapes)
    if not names:
        raise invalid("names", "at least one tensor name is required")
    if not len(names) == len(dtypes) == len(shapes):
        raise invalid("names", f"names, dtypes and shapes must have the same length (got {len(names)}, {len(dtypes)}, {len(shapes)})")
    out = []
    seen: set[str] = set()
    for name, dtype_value, shape_value in zip(names, dtypes, shapes):
        if not isinstance(name, str):
            raise invalid("names", f"tensor names must be strings, got {name!r}")
        if name in seen:
            raise invalid("names", f"tensor {name!r} appears twice")
        seen.add(name)
        ref = reference.get(name)
        if ref is None:
            raise invalid("names", f"unknown tensor {name!r} (not in the serving checkpoint)")
        try:
            shape = tuple(int(d) for d in shape_value)
        except (TypeError, ValueError):
            raise invalid("shapes", f"tensor {name!r}: shape {shape_value!r} is not a list of integers") from None
        if shape != ref.shape:
            raise invalid("shapes", f"tensor {name!r} has shape {list(shape)}, the serving model expects {list(ref.shape)}")
        dtype = parse_dtype(dtype_value, f"tensor {name!r}")
        if dtype != model_dtype:
            raise invalid("dtypes", f"tensor {name!r} has dtype {dtype}, the engine runs in {model_dtype}; send {model_dtype}")
        out.append((name, dtype, shape))
    return out


def _few(items: list[str], limit: int = 6) -> str:
    return "; ".join(items[:limit]) + (f"; ... ({len(items) - limit} more)" if len(items) > limit else "")


# ----- staging on one rank -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StageResult:
    """One rank's answer to a staging request (errors travel as values, never raised, so a
    bad update cannot fail a worker)."""

    ok: bool
    num_tensors: int = 0
    error_param: str | None = None
    error: str | None = None


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            out.append(param)
    return out


def _plain_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


class WeightStager:
    """Loads an update into copies of the parameters, then commits or discards them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        #: id(live parameter) -> (live parameter, staged copy, transformed): `transformed`
        #: when its QuantMethod quantized / repacked it after loading, so the staged tensor
        #: (in the checkpoint's layout) replaces its data and the method runs again
        self.staged: dict[int, tuple[nn.Parameter, nn.Parameter, bool]] = {}
        #: id(parameter) -> (layer, attribute name) for the layers a QuantMethod serves;
        #: rebuilt per update (processing may register new parameters)
        self.owners: dict[int, tuple[nn.Module, str]] = {}

    def _find_owners(self) -> None:
        self.owners = {}
        for module in self.model.modules():
            if getattr(module, "quant_method", None) is not None:
                for name, param in module.named_parameters(recurse=False):
                    self.owners.setdefault(id(param), (module, name))

    def _stage_for(self, param: nn.Parameter) -> nn.Parameter:
        entry = self.staged.get(id(param))
        if entry is None:
            owner = self.owners.get(id(param))
            layout = owner[0].quant_method.checkpoint_layout(*owner) if owner is not None else None
            stage = nn.Parameter(layout if layout is not None else param.data.clone(), requires_grad=False)
            for key, value in vars(param).items():  # shard tags (output_dim, ...) travel along
                if key != "weight_loader":
                    setattr(stage, key, value)
            entry = (param, stage, layout is not None)
            self.staged[id(param)] = entry
        return entry[1]

    def stage(self, weights: Iterable[tuple[str, torch.Tensor]], *, partial: bool) -> int:
        """Run `weights` through the model's loader into staged copies; returns the count.

        :param partial: the update covers some parameters only (a trainer's); the model's
            complaint about parameters left unloaded is then expected and ignored.
        :raises InvalidParameterError: naming the tensor that does not fit.
        """
        params = _unique_params(self.model)
        self._find_owners()
        saved = {id(p): p.__dict__.get("weight_loader") for p in params}
        current: list[str | None] = [None]
        failure: list[str] = []
        count = [0]

        def wrap(original):
            def staged_loader(param, loaded, *shard):
                name = current[0]
                try:
                    stage = self._stage_for(param)
                    if loaded.is_floating_point() != stage.is_floating_point():
                        raise ValueError(f"checkpoint tensor has dtype {loaded.dtype}, the parameter is {stage.dtype}")
                    (original or _plain_loader)(stage, loaded, *shard)
                except ValueError as exc:
                    failure.append(f"tensor {name!r}: {exc}")
                    raise

            return staged_loader

        def tracked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                current[0] = name
                count[0] += 1
                yield name, tensor

        for p in params:
            p.weight_loader = wrap(saved[id(p)])
        try:
            try:
                self.model.load_weights(tracked())
            except InvalidParameterError as exc:
                if failure:
                    raise invalid("weights", failure[0]) from None
                if not partial:
                    raise invalid("weights", f"the update does not fit the model: {exc}") from None
        finally:
            for p in params:
                if saved[id(p)] is None:
                    p.__dict__.pop("weight_loader", None)
                else:
                    p.weight_loader = saved[id(p)]
        return count[0]

    def commit(self) -> int:
        """Copy every staged tensor into its live parameter; returns the bytes written."""
        num_bytes = 0
        changed: set[int] = set()
        for param, stage, transformed in self.staged.values():
            if transformed:
                # quantized / repacked: the staged tensor becomes the data, processed below
                param.data = stage.data
            else:
                param.data.copy_(stage.data)
            num_bytes += param.numel() * param.element_size()
            changed.add(id(param))
        for module in self.model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None and any(id(p) in changed for p in module.parameters(recurse=False)):
                method.process_weights_after_loading(module)
        self.staged.clear()
        return num_bytes

    def discard(self) -> None:
        self.staged.clear()


def stage_safely(stager: WeightStager, weights: Iterable[tuple[str, torch.Tensor]], *, partial: bool) -> StageResult:
    """`stager.stage` with every failure turned into a StageResult (and the copies dropped)."""
    try:
        return StageResult(True, stager.stage(weights, partial=partial))
    except InvalidParameterError as exc:
        stager.discard()
        return StageResult(False, error_param=exc.param, error=str(exc))
    except Exception as exc:  # a corrupt file, a failed collective: still not the engine's death
        stager.discard()
        return StageResult(False, error_param="weights", error=f"{type(exc).__name__}: {exc}")
