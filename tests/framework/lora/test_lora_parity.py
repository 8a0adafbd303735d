"""LoRA adapters against transformers + peft (float32 greedy, random-weight base and
adapters written by peft): each adapter's output is token-identical to peft's with that
adapter, in one batch mixing three adapters and the base model, with eviction under
--max-loras 1, and the prefix cache never shares blocks between adapters."""

from __future__ import annotations


import json
from pathlib import Path

import pytest
import torch

# peft (the test extra) is imported inside the tests: at collection it would import triton
# (through transformers), before the Triton kernel tests set TRITON_INTERPRET

from lora_adapters import reference_greedy, write_adapter  # noqa: E402
from portaserve import LLM, SamplingParams  # noqa: E402
from portaserve.framework.errors import InvalidParameterError  # noqa: E402
from portaserve.framework.lora import LoRARequest  # noqa: E402
from portaserve.framework.lora.peft_adapter import load_peft_adapter  # noqa: E402

pytestmark = pytest.mark.slow
MAX_NEW = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from portaserve.models.checkpoints import write_checkpoint

    root = tmp_path_factory.mktemp("lora")
    base = str(write_checkpoint("Qwen2ForCausalLM", "tiny", root / "base"))
    adapters = [
        write_adapter(base, root / "a1", seed=1, rank=4),
        write_adapter(base, root / "a2", seed=2, rank=16, alpha=8, use_rslora=True),
        write_adapter(base, root / "a3", seed=3, rank=8, targets=("q_proj", "v_proj", "down_proj")),
    ]
    return base, adapters


def prompts(seed: int, lengths=(5, 9, 13, 7)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lengths]


def greedy(llm, prompt_list, loras) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_list],
                        SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True), lora_request=loras,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_a_mixed_batch_matches_peft(setup):
    base, adapters = setup
    llm = LLM(model=base, dtype="float32", device="cpu", enable_lora=True, max_loras=4, max_lora_rank=16)
    loras = [LoRARequest(f"a{i + 1}", i + 1, path) for i, path in enumerate(adapters)] + [None]
    batch = prompts(0)
    got = greedy(llm, batch, loras)
    for prompt, lora, tokens in zip(batch, loras, got):
        assert tokens == reference_greedy(base, lora.lora_path if lora else None, prompt, MAX_NEW)
    # the adapters matter: each gives another output than the base model on the same prompt
    same_prompt = [batch[0]] * 4
    outs = greedy(llm, same_prompt, loras)
    assert len({tuple(o) for o in outs}) == 4


def test_eviction_with_one_slot(setup):
    base, adapters = setup
    llm = LLM(model=base, dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16,
              max_cpu_loras=1)
    batch = prompts(1, (6, 8, 10, 12))
    loras = [LoRARequest("a1", 1, adapters[0]), LoRARequest("a2", 2, adapters[1])] * 2
    got = greedy(llm, batch, loras)  # the scheduler runs one adapter at a time, alternating slots
    for prompt, lora, tokens in zip(batch, loras, got):
        assert tokens == reference_greedy(base, lora.lora_path, prompt, MAX_NEW)
    assert llm.llm_engine.core.lora_stats()["lora_evictions"] >= 1


def test_the_prefix_cache_is_keyed_by_adapter(setup):
    """Same prompt, two adapters, the second run would hit the first's blocks if hashes
    ignored the adapter: its output would then be computed on the wrong K/V."""
    base, adapters = setup
    llm = LLM(model=base, dtype="float32", device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16,
              enable_prefix_caching=True, block_size=8)
    prompt = prompts(2, (33,))[0]
    first = greedy(llm, [prompt], [LoRARequest("a1", 1, adapters[0])])[0]
    second = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=MAX_NEW, temperature=0,
                                                                         ignore_eos=True),
                          lora_request=LoRARequest("a2", 2, adapters[1]), use_tqdm=False)[0]
    assert second.num_cached_tokens == 0
    assert list(second.outputs[0].token_ids) == reference_greedy(base, adapters[1], prompt, MAX_NEW)
    again = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=MAX_NEW, temperature=0,
                                                                        ignore_eos=True),
                         lora_request=LoRARequest("a1", 1, adapters[0]), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and list(again.outputs[0].token_ids) == first  # same adapter: shared


def test_adapters_that_cannot_be_served_are_refused_by_name(setup, tmp_path):
    base, adapters = setup
    llm = LLM(model=base, dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=8)
    shapes = llm.llm_engine.processor.lora_shapes()
    with pytest.raises(InvalidParameterError, match="exceeds --max-lora-rank 8"):
        load_peft_adapter("a2", 2, adapters[1], 8, shapes)
    dora = write_adapter(base, tmp_path / "dora", seed=4, rank=4, use_dora=True)
    with pytest.raises(InvalidParameterError, match="DoRA"):
        load_peft_adapter("dora", 4, dora, 8, shapes)
    saved = write_adapter(base, tmp_path / "save", seed=5, rank=4, modules_to_save=["lm_head"])
    with pytest.raises(InvalidParameterError, match="modules_to_save"):
        load_peft_adapter("save", 5, saved, 8, shapes)
    embed = write_adapter(base, tmp_path / "embed", seed=6, rank=4, targets=("embed_tokens", "q_proj"))
    with pytest.raises(InvalidParameterError, match="embed_tokens"):
        load_peft_adapter("embed", 6, embed, 8, shapes)
    narrow = {k: (v[0], v[1] // 2) for k, v in shapes.items()}  # another model's shapes
    with pytest.raises(InvalidParameterError, match=r"lora_A / lora_B have shapes"):
        load_peft_adapter("a1", 1, adapters[0], 8, narrow)
    with pytest.raises(InvalidParameterError, match="no adapter_config.json"):
        load_peft_adapter("none", 7, str(tmp_path), 8, shapes)
    cfg = json.loads((Path(adapters[0]) / "adapter_config.json").read_text())
    assert cfg["r"] == 4
    # a request naming an adapter that cannot be served is refused before it runs
    with pytest.raises(InvalidParameterError, match="DoRA"):
        greedy(llm, prompts(3, (5,)), [LoRARequest("dora", 9, dora)])
    assert greedy(llm, prompts(3, (5,)), [None])  # the engine goes on
    plain = LLM(model=base, dtype="float32", device="cpu")
    with pytest.raises(InvalidParameterError, match="enable_lora"):
        greedy(plain, prompts(3, (5,)), [LoRARequest("a1", 1, adapters[0])])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_tensor_parallel_adapters_match_peft(arch, tmp_path, monkeypatch):
    """TP=2: each rank holds its shard of every adapter (B's rows on column-parallel layers,
    A's columns on row-parallel ones); Llama splits its 2 KV heads, Qwen3 replicates its one."""
    from portaserve.models.checkpoints import write_checkpoint

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two ranks on two cores
    base = str(write_checkpoint(arch, "tiny", tmp_path / "base"))
    adapters = [write_adapter(base, tmp_path / f"a{i}", seed=30 + i, rank=8) for i in range(3)]
    loras = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)] + [None]
    llm = LLM(model=base, dtype="float32", device="cpu", enable_lora=True, max_loras=3, max_lora_rank=8,
              tensor_parallel_size=2, distributed_executor_backend="mp", num_gpu_blocks_override=64)
    try:
        batch = prompts(4)
        got = greedy(llm, batch, loras)
    finally:
        llm.shutdown()
    for prompt, lora, tokens in zip(batch, loras, got):
        assert tokens == reference_greedy(base, lora.lora_path if lora else None, prompt, MAX_NEW)


def test_adapters_over_the_quantized_default_model(smollm2_gguf, tmp_path):
    """A GGUF base kept quantized (Q4_1): the adapter's term adds to the quantized matmuls'
    output. An adapter whose B is zero changes nothing; a random one changes the answer."""
    from safetensors.torch import save_file

    llm = LLM(model=str(smollm2_gguf), enable_lora=True, max_loras=2, max_lora_rank=8)
    shapes = llm.llm_engine.processor.lora_shapes()
    assert "gguf" in str(llm.plan)

    def adapter(name: str, scale: float) -> str:
        gen = torch.Generator().manual_seed(7)
        tensors = {}
        for module, (d_in, d_out) in shapes.items():
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(8, d_in, generator=gen) * 0.05
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(d_out, 8, generator=gen) * scale
        folder = tmp_path / name
        folder.mkdir()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
        return str(folder)

    params = SamplingParams(max_tokens=16, temperature=0)
    prompt = "The capital of France is"
    base = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    zero = llm.generate(prompt, params, lora_request=LoRARequest("zero", 1, adapter("zero", 0.0)),
                        use_tqdm=False)[0].outputs[0].text
    noisy = llm.generate(prompt, params, lora_request=LoRARequest("noisy", 2, adapter("noisy", 0.5)),
                         use_tqdm=False)[0].outputs[0].text
    assert zero == base and noisy != base


def test_an_adapter_whose_files_went_fails_its_requests_alone(setup, tmp_path):
    """The worker reloads an adapter evicted from its slot and from host memory from its
    files; if they went bad since the front end checked them, its requests end with an
    error and the engine goes on."""
    import shutil

    base, adapters = setup
    doomed = shutil.copytree(adapters[0], tmp_path / "doomed")
    llm = LLM(model=base, dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_lora_rank=16,
              max_cpu_loras=1)
    first = LoRARequest("doomed", 1, str(doomed))
    greedy(llm, prompts(6, (5,)), [first])
    greedy(llm, prompts(6, (5,)), [LoRARequest("a2", 2, adapters[1])])  # evicts it from the slot and the host
    (doomed / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    out = llm.generate([{"prompt_token_ids": p} for p in prompts(6, (5, 6))],
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), lora_request=[first, None],
                       use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "error" and len(out[1].outputs[0].token_ids) == 4
    assert greedy(llm, prompts(7, (5,)), [LoRARequest("a2", 2, adapters[1])])  # the engine goes on
