"""Helpers shared by the parallel-execution tests (see conftest.py for the fixtures)."""

from __future__ import annotations

import random
import socket

from portaserve import SamplingParams

CAUSAL_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")

#: LLM(...) keyword arguments every engine here uses.
ENGINE_KW = dict(device="cpu", dtype="float32", block_size=16, num_gpu_blocks_override=48, max_num_batched_tokens=64,
                 max_num_seqs=8, skip_tokenizer_init=True)


def prompts_of(lengths, seed=0, vocab=150000):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(n)]} for n in lengths]


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def generate_ids(llm, prompts, max_tokens: int = 8) -> list[list[int]]:
    return token_ids(llm.generate(prompts, greedy(max_tokens), use_tqdm=False))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port p with p + 1 free as well (multi-node control connections use p + 1)."""
    for _ in range(50):
        p = free_port()
        if p >= 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")
