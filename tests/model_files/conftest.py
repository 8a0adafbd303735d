"""Fixtures for the GGUF tests: llama.cpp as the independent reference (the real
artifacts, `smollm2_gguf` and `minilm_folder`, are in tests/conftest.py).

- `llama_cpp`: llama.cpp's sources (its `convert_hf_to_gguf.py`, the independent GGUF
  writer) and its `llama-tokenize` tool, from `$PORTASERVE_LLAMA_CPP_DIR` (a source tree
  with `build/bin/llama-tokenize`, and `llama-perplexity` for the perplexity check;
  `ci/llama_cpp.sh DIR llama-tokenize llama-perplexity` makes one);
- `convert`: llama.cpp's converter run on an HF folder, cached per session.

Without llama.cpp the tests that need it skip, saying how to get it; CI sets
`PORTASERVE_REQUIRE_REAL_MODELS=1` so they fail instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class LlamaCpp:
    source: Path

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    @property
    def tokenize_tool(self) -> Path:
        return self.source / "build" / "bin" / "llama-tokenize"

    @property
    def perplexity_tool(self) -> Path:
        return self.source / "build" / "bin" / "llama-perplexity"

    def tokenize(self, gguf: Path, text: str, tmp_path: Path) -> list[int]:
        """llama-tokenize's ids for `text`: no BOS added; special tokens in the text are
        parsed (the tool's default), as portaserve's encode does."""
        prompt = tmp_path / "prompt.txt"
        prompt.write_bytes(text.encode("utf-8"))
        cmd = [str(self.tokenize_tool), "-m", str(gguf), "-f", str(prompt), "--ids", "--log-disable", "--no-escape",
               "--no-bos"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        line = out.stdout.strip().splitlines()[-1]
        return [int(x) for x in line.strip("[]").split(",") if x.strip()]


@pytest.fixture(scope="session")
def llama_cpp(missing) -> LlamaCpp:
    root = os.environ.get("PORTASERVE_LLAMA_CPP_DIR")
    if not root:
        missing("llama.cpp is not available: run ci/llama_cpp.sh DIR and set PORTASERVE_LLAMA_CPP_DIR=DIR")
    tools = LlamaCpp(Path(root))
    if not tools.converter.is_file() or not tools.tokenize_tool.is_file():
        missing(f"{root} has no convert_hf_to_gguf.py or build/bin/llama-tokenize (run ci/llama_cpp.sh {root})")
    return tools


@pytest.fixture(scope="session")
def convert(llama_cpp, tmp_path_factory):
    """`convert(folder, outtype, vocab_only=False)` -> the GGUF llama.cpp's converter writes.

    `convert.prefetch([(folder, outtype), ...])` runs several conversions two at a time
    first (each is a few seconds of single-threaded Python).
    """
    from concurrent.futures import ThreadPoolExecutor

    made: dict[tuple, Path] = {}

    def key_of(folder, outtype, vocab_only):
        return (str(folder), outtype, vocab_only)

    def run_converter(folder, outtype, vocab_only) -> Path:
        out = tmp_path_factory.mktemp("gguf") / f"{Path(folder).name}.{outtype}{'.vocab' if vocab_only else ''}.gguf"
        cmd = [sys.executable, str(llama_cpp.converter), str(folder), "--outtype", outtype, "--outfile", str(out)]
        if vocab_only:
            cmd.append("--vocab-only")
        # the converter imports its own gguf-py; a clean environment keeps ours off its path
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=str(llama_cpp.source))
        assert result.returncode == 0, result.stderr[-3000:]
        return out

    def run(folder: str | Path, outtype: str = "f32", vocab_only: bool = False) -> Path:
        key = key_of(folder, outtype, vocab_only)
        if key not in made:
            made[key] = run_converter(folder, outtype, vocab_only)
        return made[key]

    def prefetch(jobs) -> None:
        todo = [(str(f), t, False) for f, t in jobs if key_of(f, t, False) not in made]
        with ThreadPoolExecutor(max_workers=2) as pool:
            for key, out in zip(todo, pool.map(lambda job: run_converter(*job), todo)):
                made[key] = out

    run.prefetch = prefetch
    return run
