"""Checkpoint files: where a model's folder is, its config.json, and its safetensors.

Everything here is about files, not architectures or devices: a local HF folder, a hub
id fetched with huggingface_hub (cache first, short network timeouts, a clear error
offline), the config and generation config, the weight tensors streamed one at a time
from `model.safetensors` or its shards, and the generated demo checkpoint used when no
model is given (written through the registry's checkpoint writers, so the framework
never imports `portaserve.models`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import InvalidParameterError, invalid

logger = logging.getLogger("portaserve")

#: What a hub download fetches: configs, safetensors weights, tokenizer files,
#: sentence-transformers module folders; never .bin/.pt/.gguf/ONNX weights.
HUB_ALLOW_PATTERNS = (
    "*.json",
    "*.safetensors",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.jinja",
)
# Seconds huggingface_hub waits for the hub's metadata answer before giving up.
HUB_ETAG_TIMEOUT_S = 10.0

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"

#: The architecture and size of the demo checkpoint; bump the version when the writer
#: changes so an old cached copy is not reused.
DEMO_ARCHITECTURE = "Qwen2ForCausalLM"
DEMO_SIZE = "small"
DEMO_VERSION = "v1"
DEMO_MARKER = "portaserve_demo"


# ----- finding the folder ----------------------------------------------------------------


def resolve_model_path(model: str | os.PathLike, revision: str | None = None) -> Path:
    """The local folder of `model`: a folder as given, else a hub id from the cache or the hub.

    :raises InvalidParameterError: the folder has no config.json, or the hub id is neither
        cached nor downloadable (offline, unknown, gated); the message names the id and
        the cache folder.
    """
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise invalid("model", f"folder {str(path)!r} has no config.json (not a Hugging Face model folder)")
        return path.resolve()
    if path.exists() or text.startswith(("/", "./", "../", "~")) or text.count("/") > 1:
        raise invalid("model", f"{text!r} is not a model folder (no such directory) and not a hub id like 'org/name'")
    return _hub_snapshot(text, revision)


def hub_cache_dir() -> str:
    """Where huggingface_hub keeps downloaded repositories (HF_HUB_CACHE / HF_HOME)."""
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except Exception:  # pragma: no cover - huggingface_hub is a dependency
        return os.path.expanduser("~/.cache/huggingface/hub")


def _hub_offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE", "") or os.environ.get("TRANSFORMERS_OFFLINE", "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def _hub_snapshot(repo_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise invalid("model", f"{repo_id!r} is not a local folder, and huggingface_hub is not installed ({exc})") from None
    cache = hub_cache_dir()
    common = dict(repo_id=repo_id, revision=revision, allow_patterns=list(HUB_ALLOW_PATTERNS))
    # The cache first: a model fetched once starts with no network access at all.
    try:
        return _checked(Path(snapshot_download(**common, local_files_only=True)), repo_id)
    except InvalidParameterError:
        raise
    except Exception:
        pass
    where = f"{repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    if _hub_offline():
        raise invalid(
            "model",
            f"{where} is not in the Hugging Face cache folder {cache} and the hub is offline "
            "(HF_HUB_OFFLINE=1); download it while online, or pass a local model folder",
        )
    logger.info("fetching %s from the Hugging Face hub into %s", where, cache)
    try:
        folder = snapshot_download(**common, etag_timeout=HUB_ETAG_TIMEOUT_S)
    except Exception as exc:
        raise invalid(
            "model",
            f"cannot fetch {where} from the Hugging Face hub ({_hub_reason(exc)}); it is not in the cache "
            f"folder {cache}; check the id and your network, or pass a local model folder",
        ) from None
    return _checked(Path(folder), repo_id)


def _hub_reason(exc: BaseException) -> str:
    name = type(exc).__name__
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if name in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"):
        return f"{name}: {first}"
    if name in ("LocalEntryNotFoundError", "OfflineModeIsEnabled") or "connect" in str(exc).lower():
        return "no network connection to the hub"
    return f"{name}: {first}"


def _checked(folder: Path, repo_id: str) -> Path:
    if not (folder / "config.json").is_file():
        raise invalid("model", f"hub repository {repo_id!r} has no config.json (not a transformers model)")
    return folder


# ----- config files ----------------------------------------------------------------------


def _read_json(path: Path, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise invalid("model", f"{what} {str(path)!r} is not valid JSON: {exc}") from None


def load_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """config.json of the folder, plus `portaserve_pooling` when it is a sentence-transformers
    folder (`modules.json`): `{"mode": "mean"|"cls"|..., "normalize": bool}`."""
    folder = Path(path)
    file = folder / "config.json"
    if not file.is_file():
        raise invalid("model", f"{str(folder)!r} has no config.json")
    config = _read_json(file, "config")
    if not isinstance(config, dict):
        raise invalid("model", f"config {str(file)!r} is not a JSON object")
    pooling = load_sentence_transformers_pooling(folder)
    if pooling is not None:
        config["portaserve_pooling"] = pooling
    return config


def load_generation_config(path: str | os.PathLike) -> dict[str, Any]:
    """generation_config.json of the folder, or {} when there is none."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    config = _read_json(file, "generation config")
    return config if isinstance(config, dict) else {}


# sentence-transformers' Pooling config keys -> our mode names
_POOLING_MODES = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_lasttoken", "last"),
    ("pooling_mode_max_tokens", "max"),
)


def load_sentence_transformers_pooling(path: str | os.PathLike) -> dict[str, Any] | None:
    """The pooling a sentence-transformers folder declares, or None if it is not one.

    Reads `modules.json` (the module list: Transformer, Pooling, optional Normalize) and
    the Pooling module's `config.json` (e.g. `1_Pooling/config.json`).
    """
    folder = Path(path)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file, "sentence-transformers modules")
    mode = None
    normalize = False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith("Pooling"):
            cfg_file = folder / str(module.get("path", "")) / "config.json"
            cfg = _read_json(cfg_file, "pooling config") if cfg_file.is_file() else {}
            mode = cfg.get("pooling_mode")
            if mode is None:
                mode = next((name for key, name in _POOLING_MODES if cfg.get(key)), "mean")
            mode = {"mean_tokens": "mean", "cls_token": "cls", "lasttoken": "last", "max_tokens": "max"}.get(mode, mode)
        elif kind.endswith("Normalize"):
            normalize = True
    return {"mode": mode or "mean", "normalize": normalize}


# ----- weights ---------------------------------------------------------------------------


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files holding the folder's weights (one, or the index's shards)."""
    folder = Path(path)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = _read_json(index, "safetensors index").get("weight_map", {})
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise invalid("model", f"{str(folder)!r}: the safetensors index names missing shards {missing}")
        return [folder / s for s in shards]
    single = folder / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
    hint = f" (found {', '.join(others)}: only safetensors weights are supported)" if others else ""
    raise invalid("model", f"{str(folder)!r} has no safetensors weights{hint}")


def iter_safetensors(path: str | os.PathLike, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every weight of the folder, one tensor at a time.

    Files are memory-mapped by `safe_open`; each tensor is read when yielded and can be
    dropped once copied into its parameter, so loading never holds a second full copy of
    the model. The tensors keep the checkpoint's dtype (the loader converts).
    """
    from safetensors import safe_open
    from tqdm.auto import tqdm

    files = safetensors_files(path)
    handles = []
    total = 0
    for file in files:
        handle = safe_open(str(file), framework="pt", device="cpu")
        handles.append(handle)
        total += len(handle.keys())
    bar = tqdm(total=total, desc="Loading safetensors", unit="tensor", disable=not progress, leave=False)
    try:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update(1)
    finally:
        bar.close()


# ----- the demo checkpoint ---------------------------------------------------------------


def portaserve_cache_dir() -> Path:
    """portaserve's cache folder: $PORTASERVE_CACHE_DIR, else $XDG_CACHE_HOME/portaserve,
    else ~/.cache/portaserve."""
    explicit = os.environ.get("PORTASERVE_CACHE_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "portaserve"


def demo_checkpoint_dir() -> Path:
    return portaserve_cache_dir() / "demo" / f"{DEMO_ARCHITECTURE}-{DEMO_SIZE}-{DEMO_VERSION}"


def is_demo_checkpoint(path: str | os.PathLike) -> bool:
    file = Path(path) / "config.json"
    try:
        return bool(json.loads(file.read_text()).get(DEMO_MARKER))
    except (OSError, ValueError, AttributeError):
        return False


def ensure_demo_checkpoint(registry=None) -> Path:
    """The demo checkpoint (random weights), written on first use into the cache folder.

    Written through the registry's checkpoint writer for `DEMO_ARCHITECTURE` into a
    temporary folder and renamed into place, so concurrent first uses never see half a
    checkpoint. config.json carries `"portaserve_demo": true`, which the engine reports.
    """
    final = demo_checkpoint_dir()
    if is_demo_checkpoint(final):
        return final
    if registry is None:
        from .plugins import get_registry

        registry = get_registry()
    try:
        writer = registry.get("checkpoint_writers", DEMO_ARCHITECTURE)
    except KeyError as exc:
        raise invalid("model", f"no model given and the demo checkpoint cannot be made: {exc.args[0]}") from None
    final.parent.mkdir(parents=True, exist_ok=True)
    logger.info("writing the demo checkpoint (%s, size %s, random weights) to %s", DEMO_ARCHITECTURE, DEMO_SIZE, final)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        writer(str(tmp), DEMO_SIZE, 0)
        config_file = tmp / "config.json"
        config = json.loads(config_file.read_text())
        config[DEMO_MARKER] = True
        config_file.write_text(json.dumps(config, indent=2) + "\n")
        try:
            os.replace(tmp, final)
        except OSError:
            # another process finished first (the target is a non-empty folder): use theirs
            if not is_demo_checkpoint(final):
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
