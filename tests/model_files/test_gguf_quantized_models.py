"""Tiny random-weight GGUF decoders whose matrices mix block types the way llama.cpp's
K-quant mixes do (Q4_K q/k/gate/up, Q6_K v/down, Q8_0 embedding, Q5_K output...), served
through the quantized path ("gguf" method) and dequantized (`quantization="none"`): the
same log-probabilities within the int8-activation error, and the same greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from portaserve import LLM, SamplingParams
from portaserve.framework.gguf.blocks import random_blocks

from .gguf_files import add_bpe_vocab, finish, tiny_vocab

pytestmark = pytest.mark.slow

HIDDEN, FFN, HEADS, KV_HEADS = 256, 512, 4, 2
MIXES = {
    "k_quant_mix": {"token_embd": "Q8_0", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
                    "attn_output": "Q5_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    "legacy_mix": {"token_embd": "Q4_0", "output": "Q8_0", "attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q5_0",
                   "attn_output": "Q5_1", "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "F16"},
}


# code range x sub-block scale range of each type, divided into 0.2
BLOCK_SCALE = {"Q8_0": 0.2 / 128, "Q4_0": 0.2 / 8, "Q4_1": 0.2 / 8, "Q5_0": 0.2 / 16, "Q5_1": 0.2 / 16,
               "Q4_K": 0.2 / (32 * 8), "Q5_K": 0.2 / (32 * 16), "Q6_K": 0.2 / (64 * 32)}


def write_mixed(path, types: dict[str, str], arch: str = "llama", layers: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens, token_types, merges = tiny_vocab()
    vocab = len(tokens)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(15)
    add_bpe_vocab(writer, tokens, token_types, merges, eos_id=vocab - 1)
    head_dim = HIDDEN // HEADS

    def matrix(name, rows, cols, kind):
        type_name = types[kind]
        if type_name == "F16":
            writer.add_tensor(name, rng.normal(0, 0.05, size=(rows, cols)).astype(np.float16))
        else:
            # float16 scales sized so that random codes give weights of about 0.2
            raw = random_blocks(type_name, rows, cols, rng, scale=BLOCK_SCALE[type_name])
            writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[type_name])

    def norm(name, size):
        writer.add_tensor(name, (1 + rng.normal(0, 0.02, size=size)).astype(np.float32))

    matrix("token_embd.weight", vocab, HIDDEN, "token_embd")
    norm("output_norm.weight", HIDDEN)
    matrix("output.weight", vocab, HIDDEN, "output")
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight", HIDDEN)
        matrix(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN, "attn_q")
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN, "attn_k")
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN, "attn_v")
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim, "attn_output")
        norm(f"blk.{i}.ffn_norm.weight", HIDDEN)
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, "ffn_gate")
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, "ffn_up")
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, "ffn_down")
    finish(writer)
    return path


def _deviation(lp):
    """How far each log-probability is from the prompt's mean: the model's signal."""
    return np.array(lp) - np.mean(lp)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_quantized_path_matches_the_dequantized_file(tmp_path, mix):
    """Three engines on one file: dequantized ("none"), the "gguf" method's torch path
    (`--quantization gguf`: the packed weights dequantized per call, exact but for the
    float16 scales) and the plan's default (the CPU's C kernel: int8 activations)."""
    path = write_mixed(tmp_path / f"{mix}.gguf", MIXES[mix])
    prompts = [[5, 70, 99, 120, 33, 7, 250, 11], [200, 3, 3, 3, 41], [17] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    results, methods = {}, {}
    for quantization in ("none", "gguf", None):
        llm = LLM(str(path), dtype="float32", quantization=quantization, num_gpu_blocks_override=64)
        try:
            methods[quantization] = llm.llm_engine.spec.plan.quantization.name
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            results[quantization] = [
                ([lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:])], list(o.outputs[0].token_ids))
                for o, p in zip(outs, prompts)
            ]
        finally:
            llm.shutdown()
    assert methods["none"] in ("none", "onednn") and methods["gguf"] == "gguf" and methods[None] in ("gguf", "gguf_cpu")
    for quantization, budget in (("gguf", 0.01), (None, 0.15)):
        # over all prompts (the repeated-token one predicts the same thing at every position)
        dev_q = np.concatenate([_deviation(lp) for lp, _ in results[quantization]])
        dev_f = np.concatenate([_deviation(lp) for lp, _ in results["none"]])
        assert np.abs(dev_f).max() > 0.5  # the random model is not flat
        assert np.linalg.norm(dev_q - dev_f) <= budget * np.linalg.norm(dev_f), (quantization, dev_q, dev_f)
        assert [t[:2] for _, t in results[quantization]] == [t[:2] for _, t in results["none"]]
