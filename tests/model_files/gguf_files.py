"""GGUF files written by the tests with the `gguf` package's own writer.

`write_decoder(path, ...)`: a tiny llama/qwen2/qwen3-shaped model with chosen tensor
types and a small byte-level BPE vocabulary, for error paths and tensor-type checks.
`write_vocab(path, tokens, ...)`: a vocab-only file (llama-tokenize loads those).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType, quants

#: The byte-level alphabet (GPT-2's bytes_to_unicode): every byte as one printable character.
def byte_alphabet() -> list[str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = [], 0
    table = {}
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """256 byte tokens, a few merges, an end-of-text control token."""
    tokens = byte_alphabet()
    merges = []
    for left, right in (("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o")):
        merges.append(f"{left} {right}")
        tokens.append(left + right)
    types = [TokenType.NORMAL] * len(tokens)
    tokens.append("<|endoftext|>")
    types.append(TokenType.CONTROL)
    return tokens, [int(t) for t in types], merges


def add_bpe_vocab(writer: GGUFWriter, tokens, types, merges, pre: str = "qwen2", eos_id: int | None = None) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if eos_id is not None:
        writer.add_eos_token_id(eos_id)
        writer.add_bos_token_id(eos_id)


def write_vocab(path: Path, tokens, types, merges, pre: str, arch: str = "qwen2") -> Path:
    writer = GGUFWriter(str(path), arch)
    add_bpe_vocab(writer, tokens, types, merges, pre=pre)
    finish(writer)
    return path


def finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tensor(writer: GGUFWriter, name: str, value: np.ndarray, type_name: str = "F32") -> None:
    """`value` (float32, torch order) stored as `type_name`, quantized with gguf.quants."""
    qtype = GGMLQuantizationType[type_name]
    if type_name == "F32":
        writer.add_tensor(name, value.astype(np.float32))
    elif type_name == "F16":
        writer.add_tensor(name, value.astype(np.float16))
    else:
        writer.add_tensor(name, quants.quantize(value.astype(np.float32), qtype), raw_dtype=qtype)


def write_decoder(
    path: Path,
    arch: str = "llama",
    matrix_type: str = "F32",
    hidden: int = 64,
    layers: int = 1,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    seed: int = 0,
    extra=None,
    with_vocab: bool = True,
    configure=None,
) -> Path:
    """A tiny decoder GGUF: random weights, matrices stored as `matrix_type`; `extra`
    adds tensors ({name: (float array, type)}), `configure(writer)` more metadata."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    vocab = len(tokens)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(0 if matrix_type == "F32" else 7)
    if with_vocab:
        add_bpe_vocab(writer, tokens, types, merges, eos_id=vocab - 1)
    if configure is not None:
        configure(writer)  # more metadata
    head_dim = hidden // heads

    def mat(rows, cols):
        return rng.normal(0, 0.05, size=(rows, cols)).astype(np.float32)

    add_tensor(writer, "token_embd.weight", mat(vocab, hidden), matrix_type)
    add_tensor(writer, "output_norm.weight", 1 + rng.normal(0, 0.02, size=hidden).astype(np.float32))
    for i in range(layers):
        add_tensor(writer, f"blk.{i}.attn_norm.weight", 1 + rng.normal(0, 0.02, size=hidden).astype(np.float32))
        add_tensor(writer, f"blk.{i}.attn_q.weight", mat(heads * head_dim, hidden), matrix_type)
        add_tensor(writer, f"blk.{i}.attn_k.weight", mat(kv_heads * head_dim, hidden), matrix_type)
        add_tensor(writer, f"blk.{i}.attn_v.weight", mat(kv_heads * head_dim, hidden), matrix_type)
        add_tensor(writer, f"blk.{i}.attn_output.weight", mat(hidden, heads * head_dim), matrix_type)
        add_tensor(writer, f"blk.{i}.ffn_norm.weight", 1 + rng.normal(0, 0.02, size=hidden).astype(np.float32))
        add_tensor(writer, f"blk.{i}.ffn_gate.weight", mat(ffn, hidden), matrix_type)
        add_tensor(writer, f"blk.{i}.ffn_up.weight", mat(ffn, hidden), matrix_type)
        add_tensor(writer, f"blk.{i}.ffn_down.weight", mat(hidden, ffn), matrix_type)
    for name, (value, type_name) in (extra or {}).items():
        add_tensor(writer, name, value, type_name)
    finish(writer)
    return path
