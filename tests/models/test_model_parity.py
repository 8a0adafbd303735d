"""Every architecture against transformers on the same random weights, through the real
engine step path (Scheduler + BlockManager -> ModelRunner, see model_harness.py).

Reference: transformers' own implementation (`AutoModelForCausalLM` / `AutoModel`), one
prompt at a time (no padding). Ours: all prompts in one batch on the CPU attention
backend, block size 8 (smaller than the prompts), blocks handed out in shuffled order,
and, where a test says so, a small token budget per step, so that prompts prefill in
chunks and prefill chunks and decodes share steps.
"""

from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model_harness import embeddings, engine, greedy_generate, prompt_logits  # noqa: E402

CAUSAL = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"]
VOCAB = 151936


def random_prompts(lengths, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@functools.lru_cache(maxsize=8)
def hf_causal_with_info(folder: str, dtype: str = "float32"):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype), output_loading_info=True
    )
    model.generation_config.eos_token_id = None  # 32 tokens, whatever they are
    return model.eval(), info


def hf_causal(folder: str, dtype: str = "float32"):
    return hf_causal_with_info(folder, dtype)[0]


@functools.lru_cache(maxsize=64)
def _hf_logits(folder: str, prompt: tuple[int, ...], dtype: str) -> torch.Tensor:
    with torch.no_grad():
        return hf_causal(folder, dtype)(torch.tensor([prompt])).logits[0].float()


def hf_logits(folder: str, prompt, dtype: str = "float32") -> torch.Tensor:
    return _hf_logits(str(folder), tuple(prompt), dtype)


def hf_greedy(folder: str, prompt, max_new_tokens: int, dtype: str = "float32") -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_causal(folder, dtype).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def logits_mismatch(ours: torch.Tensor, ref: torch.Tensor, what: str) -> str | None:
    """Why `ours` is not within 1e-4 x max |logit| of `ref`, or None when it is."""
    if ours.shape != ref.shape:
        return f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    return None if err <= 1e-4 * scale else f"{what}: max abs error {err:.3g} > 1e-4 x max |logit| {scale:.3g}"


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    mismatch = logits_mismatch(ours, ref, what)
    assert mismatch is None, mismatch


# ----- float32 logits and greedy continuations --------------------------------------------


@pytest.mark.parametrize("arch", CAUSAL)
def test_transformers_loads_checkpoint_without_missing_keys(arch, checkpoint):
    folder = checkpoint(arch)
    _, info = hf_causal_with_info(folder)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


@pytest.mark.parametrize("arch", CAUSAL)
@pytest.mark.parametrize("budget", [None, 13], ids=["whole-prompts", "chunked-prefill"])
def test_prompt_logits_match_transformers(arch, budget, checkpoint):
    folder = checkpoint(arch)
    prompts = random_prompts([5, 11, 19, 33, 40], seed=1)
    ours = prompt_logits(engine(folder), prompts, token_budget=budget)
    for prompt, logits in zip(prompts, ours):
        assert_logits_close(logits, hf_logits(folder, prompt), f"{arch} prompt of {len(prompt)} tokens")


@pytest.mark.grid(keep=1)
@pytest.mark.parametrize("mutation", ["slot-offset-off-by-one", "first-two-blocks-swapped"])
def test_parity_fails_when_the_runners_slot_mapping_is_broken(mutation, checkpoint, monkeypatch):
    """A mutation test: the parity above runs through the runner's own input preparation,
    so a runner that writes K/V to the wrong slots must fail it."""
    from portaserve.framework.executor import input_batch

    real = input_batch.slot_mapping
    calls = []

    def broken(block_table, row_of_token, positions, block_size):
        calls.append(len(positions))
        if mutation == "first-two-blocks-swapped":
            block_table = block_table.copy()
            block_table[:, [0, 1]] = block_table[:, [1, 0]]
            return real(block_table, row_of_token, positions, block_size)
        slots = real(block_table, row_of_token, positions, block_size)
        return slots - slots % block_size + (slots + 1) % block_size  # next slot of the same block

    monkeypatch.setattr(input_batch, "slot_mapping", broken)
    folder = checkpoint("LlamaForCausalLM")
    prompts = random_prompts([11, 19, 33], seed=1)
    ours = prompt_logits(engine(folder), prompts, token_budget=13)
    assert calls, "the runner did not use input_batch.slot_mapping"
    mismatches = [logits_mismatch(o, hf_logits(folder, p), f"prompt of {len(p)}") for p, o in zip(prompts, ours)]
    assert any(mismatches), f"{mutation}: parity still passes with a broken slot mapping"


@pytest.mark.grid(keep=1)
@pytest.mark.parametrize("arch", CAUSAL)
def test_greedy_continuations_match_generate(arch, checkpoint):
    folder = checkpoint(arch)
    prompts = random_prompts([3, 9, 12, 17, 20, 25, 30, 41], seed=2)
    # 24 tokens a step: long prompts prefill over several steps while short ones already decode
    ours = greedy_generate(engine(folder), prompts, 32, token_budget=24)
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy(folder, prompt, 32), f"{arch}: prompt of {len(prompt)} tokens diverged"
    # a continuation that repeats one token would hide a misread KV cache
    assert sum(len(set(t)) for t in ours) / len(ours) >= 4, [len(set(t)) for t in ours]


@pytest.mark.grid(keep=1)
@pytest.mark.parametrize("arch", CAUSAL)
def test_bfloat16_top1_agrees_with_transformers(arch, checkpoint):
    folder = checkpoint(arch)  # float32 on disk: both sides convert to bfloat16 on load
    prompts = random_prompts([30, 45, 60, 64, 50, 40, 33, 64], seed=3)
    eng = engine(folder, dtype="bfloat16")
    assert eng.model.model.embed_tokens.weight.dtype == torch.bfloat16
    ours = prompt_logits(eng, prompts, token_budget=100)
    agree = total = 0
    for prompt, logits in zip(prompts, ours):
        ref = hf_logits(folder, prompt, "bfloat16")
        agree += int((ref.argmax(-1) == logits.argmax(-1)).sum())
        total += len(prompt)
    assert agree / total >= 0.99, f"{arch}: bf16 top-1 agreement {agree}/{total}"


def test_sliding_window_changes_the_result(checkpoint):
    """Control for Mistral's window of 8: transformers without the window disagrees with us."""
    folder = checkpoint("MistralForCausalLM")
    prompt = random_prompts([40], seed=4)[0]
    ours = prompt_logits(engine(folder), [prompt])[0]
    config = transformers.AutoConfig.from_pretrained(folder)
    config.sliding_window = None
    full = transformers.AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = full(torch.tensor([prompt])).logits[0]
    assert torch.allclose(ours[:8], ref[:8], atol=1e-4)  # within the window: identical
    assert (ours[8:] - ref[8:]).abs().max() > 1e-2


def test_qwen2_mixes_full_and_sliding_layers(checkpoint):
    from portaserve.models.qwen2 import Qwen2ForCausalLM

    folder = checkpoint("Qwen2ForCausalLM")
    runner = engine(folder).runner
    assert runner.layer_types == ["full", "full", "sliding"]
    assert set(runner.backends) == {"full", "sliding"}
    assert runner.backends["sliding"].spec.sliding_window == 16
    assert Qwen2ForCausalLM.attention_specs({**_config(folder)}, torch.float32, "auto")["full"].sliding_window is None


def _config(folder):
    from portaserve.framework.checkpoint import load_hf_config

    return load_hf_config(folder)


# ----- embeddings, rope scaling ---------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_llama_tied_and_untied_embeddings(tied, checkpoint):
    folder = checkpoint("LlamaForCausalLM", config_overrides={"tie_word_embeddings": tied})
    eng = engine(folder)
    model = eng.model
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    from safetensors import safe_open

    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) != tied
    prompts = random_prompts([6, 21], seed=5)
    for prompt, logits in zip(prompts, prompt_logits(eng, prompts)):
        assert_logits_close(logits, hf_logits(folder, prompt), f"tied={tied}")


ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.mark.grid(keep=1)
@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_scaling_matches_transformers(variant, checkpoint):
    # max_position_embeddings 32: the prompts and continuations run past the trained length,
    # where dynamic NTK rescales per sequence length (llama3 configs state the long length
    # itself, so there the trained length is original_max_position_embeddings = 16).
    max_len = 128 if variant == "llama3" else 32
    overrides = {"rope_scaling": ROPE_VARIANTS[variant], "max_position_embeddings": max_len}
    folder = checkpoint("LlamaForCausalLM", config_overrides=overrides)
    prompts = random_prompts([12, 30, 45], seed=6)
    eng = engine(folder, max_model_len=max(max_len, 64))
    for prompt, logits in zip(prompts, prompt_logits(eng, prompts)):
        assert_logits_close(logits, hf_logits(folder, prompt), f"{variant}, prompt of {len(prompt)}")
    # greedy from 28 tokens to 48: crosses max_position_embeddings mid-decode
    gen_prompts = random_prompts([28, 20], seed=7)
    ours = greedy_generate(eng, gen_prompts, 20, token_budget=9)
    for prompt, tokens in zip(gen_prompts, ours):
        assert tokens == hf_greedy(folder, prompt, 20), f"{variant}: continuation of {len(prompt)} diverged"
    # control: the scaling is not a no-op on these prompts
    plain = checkpoint("LlamaForCausalLM", config_overrides={"max_position_embeddings": max_len})
    long = prompts[-1]
    assert (hf_logits(plain, long) - hf_logits(folder, long)).abs().max() > 1e-3


def test_rope_parameters_format_of_transformers_5(checkpoint):
    """config.json in the newer `rope_parameters` layout reads like rope_theta + rope_scaling."""
    from portaserve.models.layers.rotary import rope_parameters

    legacy = {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}, "max_position_embeddings": 64}
    new = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}, "max_position_embeddings": 64}
    assert rope_parameters(legacy) == rope_parameters(new) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
    with pytest.raises(ValueError, match="longrope"):
        rope_parameters({"rope_scaling": {"rope_type": "longrope"}})


# ----- BERT embeddings ----------------------------------------------------------------------


@pytest.mark.parametrize(("pooling", "normalize"), [("mean", True), ("cls", True), ("mean", False)])
def test_bert_embeddings_match_transformers(pooling, normalize, checkpoint):
    from portaserve.framework.checkpoint import load_hf_config

    folder = checkpoint("BertModel", pooling=pooling, normalize=normalize)
    assert load_hf_config(folder)["portaserve_pooling"] == {"mode": pooling, "normalize": normalize}
    eng = engine(folder)
    assert eng.model.is_pooling and eng.runner.kv_caches == []
    prompts = random_prompts([4, 13, 29, 50], seed=8)
    ours = embeddings(eng, prompts)
    hf, info = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.eval()
    for prompt, emb in zip(prompts, ours):
        with torch.no_grad():
            states = hf(torch.tensor([prompt])).last_hidden_state[0]
        ref = states.mean(0) if pooling == "mean" else states[0]
        if normalize:
            ref = torch.nn.functional.normalize(ref, dim=-1)
            assert abs(emb.norm().item() - 1.0) < 1e-5
        cos = torch.nn.functional.cosine_similarity(emb, ref, dim=0).item()
        assert cos >= 0.9999, f"{pooling}: cosine {cos} for a prompt of {len(prompt)}"
        assert torch.allclose(emb, ref, atol=1e-4, rtol=1e-4)


# ----- loading ------------------------------------------------------------------------------


def test_sharded_checkpoint_loads_identically(checkpoint):
    single = checkpoint("LlamaForCausalLM")
    sharded = checkpoint("LlamaForCausalLM", max_shard_bytes=8 * 2**20)
    import os

    shards = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    assert len(shards) >= 3 and "model.safetensors" not in shards
    a = engine(single).model.state_dict()
    b = engine(sharded).model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    prompt = random_prompts([14], seed=9)[0]
    assert_logits_close(prompt_logits(engine(sharded), [prompt])[0], hf_logits(sharded, prompt), "sharded")


@pytest.mark.parametrize(("stored", "requested", "expected"), [
    ("float32", "bfloat16", torch.bfloat16),
    ("bfloat16", "auto", torch.bfloat16),
    ("bfloat16", "float32", torch.float32),
    ("float32", "float16", torch.float16),
])
def test_dtype_conversion_on_load(stored, requested, expected, checkpoint):
    from safetensors.torch import load_file

    folder = checkpoint("Qwen3ForCausalLM", dtype=stored)
    model = engine(folder, dtype=requested).model
    raw = load_file(f"{folder}/model.safetensors")
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.q_norm.weight", "model.norm.weight"):
        param = model.get_parameter(name)
        assert param.dtype == expected
        assert torch.equal(param, raw[name].to(expected)), name
    # state_dict, not the Parameter: on the CPU the linear weights are repacked for oneDNN
    # and the Parameter is a placeholder
    qkv = model.state_dict()["model.layers.0.self_attn.qkv_proj.weight"]
    fused = torch.cat([raw[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]).to(expected)
    assert qkv.dtype == expected and torch.equal(qkv, fused)


def test_unexpected_and_missing_tensors_are_clear_errors(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from portaserve.framework.errors import InvalidParameterError

    src = checkpoint("MistralForCausalLM")
    tensors = load_file(f"{src}/model.safetensors")
    for label, edit, pattern in [
        ("extra", lambda t: {**t, "model.layers.0.mlp.bogus.weight": torch.zeros(2)}, "unexpected.*mlp.bogus"),
        ("missing", lambda t: {k: v for k, v in t.items() if "layers.1.self_attn.k_proj" not in k},
         r"missing.*layers\.1\.self_attn\.qkv_proj\.weight \(k\)"),
        ("shape", lambda t: {**t, "model.norm.weight": torch.ones(3)}, "model.norm.weight.*shape"),
    ]:
        folder = tmp_path / label
        shutil.copytree(src, folder)
        save_file(edit(tensors), str(folder / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(InvalidParameterError, match=pattern):
            engine(folder)


def test_unknown_architecture_lists_the_supported_ones(checkpoint, tmp_path):
    import json
    import shutil

    from model_harness import make_plan

    from portaserve.framework.errors import UnsupportedError

    folder = tmp_path / "foo"
    shutil.copytree(checkpoint("LlamaForCausalLM"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError) as err:
        make_plan(folder)
    message = str(err.value)
    assert "FooForCausalLM" in message
    for arch in [*CAUSAL, "BertModel"]:
        assert arch in message
