"""A checkpoint with its later decoder layers dropped: a draft model for speculative
decoding tests and benchmarks (the target's own first layers, embeddings and head, so
its guesses agree with the target's often but not always), from a safetensors folder
or a GGUF file (tensors copied as stored, quantized ones included).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.")


def _kept(name: str, pattern: re.Pattern, num_layers: int) -> bool:
    match = pattern.match(name)
    return match is None or int(match.group(1)) < num_layers


def truncate_checkpoint(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """Write `src` with only its first `num_layers` decoder layers to `dst` (a folder for
    a safetensors checkpoint, a file for a GGUF one). Returns what was written."""
    src, dst = Path(src), Path(dst)
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if src.is_file() and src.suffix == ".gguf":
        return _truncate_gguf(src, dst, num_layers)
    return _truncate_folder(src, dst, num_layers)


def _truncate_folder(src: Path, dst: Path, num_layers: int) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
            shutil.copy(item, dst / item.name)
    config = json.loads((src / "config.json").read_text())
    if num_layers > config["num_hidden_layers"]:
        raise ValueError(f"num_layers {num_layers} exceeds the model's {config['num_hidden_layers']}")
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types",):  # per-layer lists follow the layers
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    if isinstance(config.get("max_window_layers"), int):
        config["max_window_layers"] = min(config["max_window_layers"], num_layers)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{src} holds no .safetensors files")
    for shard in shards:
        tensors.update({k: v for k, v in load_file(shard).items() if _kept(k, _HF_LAYER, num_layers)})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _truncate_gguf(src: Path, dst: Path, num_layers: int) -> Path:
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    block_count = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    if num_layers > reader.get_field(block_count).contents():
        raise ValueError(f"num_layers {num_layers} exceeds the model's {reader.get_field(block_count).contents()}")
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = num_layers if field.name == block_count else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    tensors = [t for t in reader.tensors if _kept(t.name, _GGUF_BLOCK, num_layers)]
    for tensor in tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes,
                               tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return dst
