"""GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py) from
random-weight HF folders: they load and generate token-identical to transformers.

The reference is transformers on the original folder. For f16, bf16 and q8_0 files its
weights are first rounded the way the file stores them: each tensor's type is read off
the file (found by `gguf`'s own HF-to-GGUF name map) and the weight goes through
`gguf.quants.quantize` and `dequantize` at that type. Neither the names nor the
rounding go through portaserve's loader. The engine computes in float32, greedy.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from portaserve import LLM, SamplingParams

from .hf_reference import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
MAX_TOKENS = 12


def prompts():
    rng = random.Random(5)
    return [[rng.randrange(100, 150000) for _ in range(n)] for n in (4, 19, 40)]


def round_like_the_file(model, gguf_path, arch: str) -> None:
    """Put every weight of `model` through the type the file stores it in."""
    import gguf

    from portaserve.framework.gguf import open_gguf

    # the tensor types as the file records them (the gguf package's reader)
    types = {t.name: gguf.GGMLQuantizationType[t.type_name] for t in open_gguf(gguf_path).tensors}
    gguf_arch = {"LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA, "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
                 "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3}[arch]
    names = gguf.get_tensor_name_map(gguf_arch, model.config.num_hidden_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if gguf_name not in types:  # a tied lm_head is the embedding, already rounded
                assert name == "lm_head.weight" and model.config.tie_word_embeddings, name
                continue
            qtype = types[gguf_name]
            value = param.detach().float().numpy()
            rounded = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype)
            param.copy_(torch.from_numpy(np.asarray(rounded, dtype=np.float32).reshape(value.shape)))


@pytest.fixture(scope="module")
def folders(tmp_path_factory, convert):
    from portaserve.models.checkpoints import write_checkpoint

    made = {}
    for arch in ARCHS:
        folder = tmp_path_factory.mktemp(arch)
        # no sliding window: GGUF (and llama.cpp) has none for these architectures
        overrides = {"use_sliding_window": False} if arch == "Qwen2ForCausalLM" else None
        write_checkpoint(arch, "tiny", folder, 3, dtype="float32", tokenizer=True, config_overrides=overrides)
        made[arch] = folder
    convert.prefetch([(folder, outtype) for folder in made.values() for outtype in OUTTYPES])
    return made


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_converted_gguf_generates_like_transformers(folders, convert, arch, outtype):
    from transformers import AutoModelForCausalLM

    folder = folders[arch]
    gguf_path = convert(folder, outtype)
    # a quantized file keeps its blocks (the "gguf" method); named explicitly, the method runs
    # its exact torch path, so greedy tokens match transformers on the file's rounded weights
    # (the CPU's default int8-activation kernel is checked against this path elsewhere:
    # test_gguf_quantized_models.py)
    quantization = "gguf" if outtype == "q8_0" else None
    llm = LLM(str(gguf_path), dtype="float32", quantization=quantization, num_gpu_blocks_override=64)
    try:
        if quantization:
            assert llm.llm_engine.spec.plan.quantization.name == "gguf"
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        if outtype != "f32":
            round_like_the_file(reference, gguf_path, arch)
        expected = [hf_greedy(reference, p, MAX_TOKENS) for p in prompts()]
        assert llm.llm_engine.spec.hf_config["architectures"] == [arch]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    finally:
        llm.shutdown()


def test_an_engine_serving_a_gguf_takes_weight_updates_from_the_hf_folder(folders, convert):
    """Live weight updates check names and shapes against the GGUF's tensors (under HF names).

    Float updates need float parameters: the file is served dequantized
    (`quantization="none"`); its quantized path holds codes, and an update of float
    tensors into them is refused naming the tensor (below)."""
    from transformers import AutoModelForCausalLM

    folder = folders["LlamaForCausalLM"]
    quantized = LLM(str(convert(folder, "q8_0")), dtype="float32", num_gpu_blocks_override=64)
    try:
        with pytest.raises(Exception, match=r"tensor '[\w.]+': checkpoint tensor has dtype torch.float32, the parameter is torch.uint8"):
            quantized.update_weights(str(folder))
    finally:
        quantized.shutdown()
    llm = LLM(str(convert(folder, "q8_0")), dtype="float32", quantization="none", num_gpu_blocks_override=64)
    try:
        assert llm.update_weights(str(folder))["weights_version"] == 1
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(reference, p, MAX_TOKENS) for p in prompts()]
    finally:
        llm.shutdown()
