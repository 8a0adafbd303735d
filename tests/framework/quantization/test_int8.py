"""The int8 weight-only method: quantization math, each kernel against a float64
reference, and a whole tiny model against the unquantized one (logit error, top-1
agreement, weight memory measured from the parameters)."""

from __future__ import annotations

import random

import pytest
import torch
from quant_harness import layer_bytes, linear_layers, load_model, prompt_logits

from portaserve.framework.quantization.int8 import dequantize_int8, quantize_int8_per_channel
from portaserve.framework.quantization.int8_kernels import (
    CpuInt8PackKernel,
    TorchDequantKernel,
    TritonInt8Kernel,
    choose_int8_kernel,
)

# Measured on the tiny fp32/bf16 Qwen2 and Llama checkpoints (4 random 24-token prompts):
# logits' relative error 0.016-0.023, greedy top-1 agreement 0.90-0.96. The bounds leave
# room for other seeds but fail on a wrong scale, a transposed weight or a dropped bias.
MAX_LOGIT_REL_ERR = 0.04
MIN_TOP1_AGREEMENT = 0.85


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_quantize_per_channel():
    torch.manual_seed(0)
    w = torch.randn(6, 40) * torch.tensor([0.01, 0.1, 1.0, 10.0, 0.5, 0.0])[:, None]  # a zero row too
    q, scale = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (6,)
    assert int(q.abs().max()) == 127  # each nonzero row uses the full range
    torch.testing.assert_close(scale[:5], w[:5].abs().amax(1) / 127)
    assert scale[5] == 1.0 and not q[5].any()
    # round to nearest: every element within half a step of its row's scale
    err = (dequantize_int8(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel_cls", [CpuInt8PackKernel, TorchDequantKernel])
@pytest.mark.parametrize("shape", [(1, 64, 96), (7, 144, 40), (65, 64, 24)])
def test_cpu_kernels_vs_reference(kernel_cls, dtype, shape):
    m, k, n = shape
    torch.manual_seed(m + k)
    w = torch.randn(n, k) * 0.05
    q, scale = quantize_int8_per_channel(w)
    x, bias = torch.randn(m, k).to(dtype), torch.randn(n).to(dtype)
    layer = torch.nn.Module()
    kernel = kernel_cls()
    kernel.prepare(layer, q, scale)
    y = kernel.matmul(layer, x, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = x.double() @ dequantize_int8(q, scale).double().t() + bias.double()
    # the CPU kernel multiplies in bf16 (scales and activations rounded to it)
    tol = 2e-2 if dtype == torch.bfloat16 or kernel_cls is CpuInt8PackKernel else 2e-3 if dtype == torch.float16 else 1e-5
    assert rel(y, ref) < tol


def test_kernel_choice():
    """By the platform's declared features, never by the device."""
    from portaserve.platforms.cpu.platform import CpuPlatform

    cpu = CpuPlatform(CpuPlatform.probe()).capabilities().features
    assert "int8_weight_pack_mm" in cpu
    assert isinstance(choose_int8_kernel(cpu, torch.bfloat16, 896), CpuInt8PackKernel)
    # torch 2.13's bf16 int8pack path segfaults on AVX-512 unless in_features % 16 == 0
    # (136 crashes there): the fallback serves those
    assert isinstance(choose_int8_kernel(cpu, torch.bfloat16, 37), TorchDequantKernel)
    assert isinstance(choose_int8_kernel(cpu, torch.bfloat16, 136), TorchDequantKernel)
    # a platform with Triton (the GPUs) gets the Triton kernel, one with neither (XLA) the torch one
    gpu = frozenset({"int8_matmul", "triton"})
    assert isinstance(choose_int8_kernel(gpu, torch.bfloat16, 37), TritonInt8Kernel)
    assert isinstance(choose_int8_kernel(frozenset({"int8_matmul", "xla"}), torch.float16, 896), TorchDequantKernel)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "LlamaForCausalLM"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_logits_close_to_unquantized(checkpoint, arch, dtype):
    folder = checkpoint(arch, dtype="float32")
    ref, q = load_model(folder, dtype=dtype), load_model(folder, dtype=dtype, quantization="int8")
    assert q.plan.quantization.name == "int8" and ref.plan.quantization.name == ref.plan.unquantized_method
    rng = random.Random(1)
    errs, agree, total = [], 0, 0
    for _ in range(4):
        prompt = [rng.randrange(100, 150000) for _ in range(24)]
        a, b = prompt_logits(ref, prompt), prompt_logits(q, prompt)
        errs.append(rel(b, a))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    assert max(errs) < MAX_LOGIT_REL_ERR, errs
    assert agree / total >= MIN_TOP1_AGREEMENT, agree / total


def test_model_matches_dequantized_weights(checkpoint):
    """The int8 model computes exactly the dequantized model (up to its bf16 matmul): the
    error above comes from rounding the weights, not from the kernel."""
    folder = checkpoint("Qwen2ForCausalLM", dtype="float32")
    q = load_model(folder, dtype="float32", quantization="int8")
    deq = load_model(folder, dtype="float32", quantization="none")  # plain weights, edited below
    for (name, ql), (_, dl) in zip(linear_layers(q.model), linear_layers(deq.model)):
        w = dl.weight.data
        qw, s = quantize_int8_per_channel(w)
        w.copy_(dequantize_int8(qw, s))
        assert torch.equal(ql.weight, qw), name
    prompt = list(range(500, 524))
    assert rel(prompt_logits(q, prompt), prompt_logits(deq, prompt)) < 0.01


@pytest.mark.parametrize("dtype,min_ratio", [("float32", 3.8), ("bfloat16", 1.9)])
def test_weight_memory(checkpoint, dtype, min_ratio):
    folder = checkpoint("Qwen2ForCausalLM", dtype="float32")
    ref, q = load_model(folder, dtype=dtype, quantization="none"), load_model(folder, dtype=dtype, quantization="int8")
    act = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    expected = 0
    for (name, rl), (_, ql) in zip(linear_layers(ref.model), linear_layers(q.model)):
        n, k = rl.weight.shape
        assert ql.weight.dtype == torch.int8 and tuple(ql.weight.shape) == (n, k), name
        # int8 weight + one bf16 scale per output channel (+ the bias, kept in the model dtype)
        expected += n * k + 2 * n + (n * act if rl.bias is not None else 0)
    before = sum(layer_bytes(m) for _, m in linear_layers(ref.model))
    after = sum(layer_bytes(m) for _, m in linear_layers(q.model))
    assert after == expected
    assert before / after >= min_ratio
    # the whole model shrinks by exactly what the linear layers lost (embeddings stay)
    total = lambda m: sum(p.numel() * p.element_size() for p in {id(p): p for p in m.parameters()}.values())  # noqa: E731
    assert total(ref.model) - total(q.model) == before - after


def test_engine_greedy_runs_int8(checkpoint):
    """`LLM(quantization="int8")` end to end: the plan says int8 and greedy decoding works."""
    from portaserve import LLM, SamplingParams

    folder = checkpoint("Qwen2ForCausalLM", tokenizer=True)
    llm = LLM(folder, quantization="int8", dtype="float32", max_model_len=128)
    assert llm.plan.quantization.name == "int8" and "--quantization int8" in llm.plan.quantization.reason
    out = llm.generate([{"prompt_token_ids": list(range(900, 916))}], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
