"""GGUF files (llama.cpp's format) as models and tokenizers, read with the `gguf` package.

- `file`: opening and validating a file, typed metadata access;
- `config`: the metadata as the HF config.json the model code reads;
- `weights`: the tensors under their HF names, dequantized, llama's Q/K permutation undone;
- `tokenizer` and `pretokenizers`: the vocabulary as a `tokenizers.Tokenizer`.

The rest of portaserve sees a GGUF file through `framework.checkpoint` (config, weights)
and `Tokenizer.from_pretrained` like an HF folder; the format's quirks stay here.
"""

from .file import GGUF_SUFFIX, GGUFFile, is_gguf_path, open_gguf

__all__ = ["GGUF_SUFFIX", "GGUFFile", "is_gguf_path", "open_gguf"]
