"""The default model through its quantized path (the "gguf" method: Q4_1 / Q8_0 blocks kept
in memory, int8 activations on the CPU) against the same file dequantized: perplexity of
a fixed text within 1%, mostly the same greedy tokens, the same chat answer, and the
weights resident at about the file's size; and against llama.cpp's own `llama-perplexity`
on the same file and text."""

from __future__ import annotations

import math
import re
import subprocess
import sysconfig
from pathlib import Path

import pytest

from portaserve import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TEXT = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The majority of the forest is "
    "contained within Brazil, with 60% of the rainforest, followed by Peru with 13% and Colombia with 10%. "
    "Water is a chemical compound made of two hydrogen atoms and one oxygen atom. It covers about seventy "
    "percent of the surface of the Earth and is essential for all known forms of life. In the evening the "
    "children walked home along the river, talking about the games they had played and the food they would eat. "
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
)
PROMPTS = ["The three primary colors are", "Q: What is 17 + 25?\nA:", "Once upon a time, in a small village by the sea,",
           "import numpy as np\nx = np.arange(10)\nprint("]


def _nll(engine: LLM, ids: list[int]) -> float:
    out = engine.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return -sum(out.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))) / (len(ids) - 1)


@pytest.fixture(scope="module")
def engines(smollm2_gguf):
    quantized = LLM(str(smollm2_gguf), dtype="float32", num_gpu_blocks_override=256)
    dense = LLM(str(smollm2_gguf), dtype="float32", quantization="none", num_gpu_blocks_override=256)
    yield quantized, dense
    quantized.shutdown()
    dense.shutdown()


def test_the_plan_keeps_the_file_quantized(engines):
    quantized, dense = engines
    assert quantized.llm_engine.spec.plan.quantization.name in ("gguf", "gguf_cpu")
    assert dense.llm_engine.spec.plan.quantization.name in ("none", "onednn")


@pytest.fixture
def int8_everywhere(monkeypatch):
    """The CPU's int8 dot products for prompts too (a prefill normally multiplies by the
    weight expanded to the activation dtype, which is exact): what decode computes."""
    from portaserve.platforms.cpu import gguf_linear

    for name in ("GEMM_ROWS", "DEQUANTIZE_ROWS", "DEQUANTIZE_ROWS_F32"):
        monkeypatch.setattr(gguf_linear, name, 1 << 30)


def test_perplexity_within_one_percent_of_the_dequantized_path(engines, int8_everywhere):
    quantized, dense = engines
    ids = quantized.get_tokenizer().encode(TEXT)
    assert len(ids) > 100
    ppl_q, ppl_f = math.exp(_nll(quantized, ids)), math.exp(_nll(dense, ids))
    assert ppl_f < 40  # a real model on real text, not noise
    assert abs(ppl_q - ppl_f) / ppl_f < 0.01, (ppl_q, ppl_f)


def test_greedy_continuations_mostly_agree(engines, int8_everywhere):
    """The first greedy tokens agree; past them one flipped near tie changes the rest of a
    free-running continuation (a 1e-6 change in summation order flipped 10 of 64 tokens),
    so the rest is compared teacher-forced: the quantized model's top token after each
    prefix of the dense model's continuation, with int8 activations everywhere."""
    quantized, dense = engines
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids) for o in quantized.generate(PROMPTS, params, use_tqdm=False)]
    ref_outs = dense.generate(PROMPTS, params, use_tqdm=False)
    ref = [list(o.outputs[0].token_ids) for o in ref_outs]
    assert all(a[:4] == b[:4] for a, b in zip(ours, ref)), (ours, ref)
    agree = total = 0
    for o in ref_outs:
        ids, start = list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids)
        forced = quantized.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                                    use_tqdm=False)[0]
        for j in range(start, len(ids)):
            top = max(forced.prompt_logprobs[j].items(), key=lambda kv: kv[1].logprob)[0]
            agree, total = agree + (top == ids[j]), total + 1
    assert agree >= 0.9 * total, (agree, total)  # 61 / 64 measured


def test_the_packed_weights_are_about_the_files_size_and_survive_sleep(engines, smollm2_gguf):
    """Q4_1 packs to 5 bits a weight and Q8_0 to 9 (8.5 in the file); sleep(level=2)
    offloads exactly those bytes and wake_up restores them (the same greedy tokens)."""
    quantized, _ = engines
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = quantized.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    released = quantized.llm_engine.sleep(level=2)
    assert 0.9 * smollm2_gguf.stat().st_size <= released["weights_bytes"] <= 1.1 * smollm2_gguf.stat().st_size, released
    quantized.llm_engine.wake_up()
    assert quantized.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids == before


def _license_text() -> str:
    """A fixed English text every Python installation has (its license), ~1,500 tokens."""
    return (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()[:6000]


def test_perplexity_close_to_llama_cpps_on_the_same_file(engines, smollm2_gguf, llama_cpp, missing, tmp_path,
                                                        int8_everywhere):
    """llama-perplexity's method: chunks of n_ctx tokens, each token of a chunk's second
    half scored given the chunk before it; the same chunks through portaserve, int8
    activations throughout as llama.cpp's Q8 blocks."""
    if not llama_cpp.perplexity_tool.is_file():
        missing(f"no {llama_cpp.perplexity_tool} (ci/llama_cpp.sh DIR llama-tokenize llama-perplexity)")
    quantized, _ = engines
    n_ctx, chunks = 256, 4
    text = _license_text()
    (tmp_path / "text.txt").write_text(text)
    cmd = [str(llama_cpp.perplexity_tool), "-m", str(smollm2_gguf), "-f", str(tmp_path / "text.txt"), "-c", str(n_ctx),
           "-b", str(n_ctx), "--chunks", str(chunks), "-t", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    theirs = float(re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr).group(1))
    ids = quantized.get_tokenizer().encode(text)  # the file adds no BOS, as llama.cpp reads it
    assert len(ids) >= n_ctx * chunks
    nll, count = 0.0, 0
    for c in range(chunks):
        chunk = ids[c * n_ctx:(c + 1) * n_ctx]
        res = quantized.generate([{"prompt_token_ids": chunk}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                 use_tqdm=False)[0]
        for j in range(n_ctx // 2, n_ctx - 1):
            nll -= res.prompt_logprobs[j + 1][chunk[j + 1]].logprob
            count += 1
    ours = math.exp(nll / count)
    assert 2 < theirs < 100
    assert abs(ours - theirs) / theirs < 0.03, (ours, theirs)
