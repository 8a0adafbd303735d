"""Reading PEFT adapters without a model (fast): what is refused, and how."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from portaserve.framework.lora.peft_adapter import LoRALoadError, load_peft_adapter

SHAPES = {"model.layers.0.self_attn.q_proj": (16, 16), "model.layers.0.mlp.down_proj": (32, 16)}


def adapter(folder, config, tensors=None) -> str:
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if tensors is None:
        tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 16),
                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(16, 4)}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def test_scaling_is_folded_into_b(tmp_path):
    loaded = load_peft_adapter("a", 1, adapter(tmp_path / "a", {"r": 4, "lora_alpha": 8}), 16, SHAPES)
    a, b = loaded.weights["model.layers.0.self_attn.q_proj"]
    assert torch.equal(a, torch.ones(4, 16)) and torch.equal(b, torch.full((16, 4), 2.0))
    rs = load_peft_adapter("a", 1, adapter(tmp_path / "rs", {"r": 4, "lora_alpha": 8, "use_rslora": True}), 16, SHAPES)
    assert torch.equal(rs.weights["model.layers.0.self_attn.q_proj"][1], torch.full((16, 4), 4.0))  # 8 / sqrt(4)


@pytest.mark.parametrize("config, words", [
    ("[1, 2]", "JSON object"),
    ("{", "not valid JSON"),
    ({"r": None}, "r must be an integer"),
    ({"r": [4]}, "r must be an integer"),
    ({"r": 4, "lora_alpha": "x"}, "lora_alpha a number"),
    ({"r": 32}, "exceeds --max-lora-rank 16"),
    ({"r": 4, "use_dora": True}, "DoRA"),
    ({"r": 4, "bias": "all"}, "biases"),
    ({"r": 4, "peft_type": "IA3"}, "IA3"),
    ({"r": 4, "rank_pattern": {"q_proj": 8}}, "rank_pattern"),
])
def test_bad_configs_are_load_errors(tmp_path, config, words):
    with pytest.raises(LoRALoadError, match=words) as err:
        load_peft_adapter("a", 1, adapter(tmp_path / "a", config), 16, SHAPES)
    assert err.value.param == "lora_path"


def test_bad_files_are_load_errors(tmp_path):
    folder = adapter(tmp_path / "a", {"r": 4})
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LoRALoadError, match="cannot be read"):
        load_peft_adapter("a", 1, folder, 16, SHAPES)
    only_a = adapter(tmp_path / "b", {"r": 4}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                                               torch.ones(4, 16)})
    with pytest.raises(LoRALoadError, match="lora_A only"):
        load_peft_adapter("b", 2, only_a, 16, SHAPES)
    other = adapter(tmp_path / "c", {"r": 4}, {"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight":
                                               torch.ones(4, 16),
                                               "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight":
                                               torch.ones(16, 4)})
    with pytest.raises(LoRALoadError, match="no module 'model.layers.9"):
        load_peft_adapter("c", 3, other, 16, SHAPES)
    with pytest.raises(LoRALoadError, match="not a folder"):
        load_peft_adapter("d", 4, str(tmp_path / "missing"), 16, SHAPES)
