"""LoRA's cost on decode: batch-32 decode step time with 4 different adapters (rank 16 on all
seven projections) against the base model alone, and the lora_linear op by itself.

    python benchmarks/lora.py [--batch 32] [--adapters 4] [--rank 16] [--steps 32] [--op-only]

Checkpoint: `bench` (Qwen2-0.5B-shaped, random weights, bfloat16), built once under the
cache folder; adapters: random, PEFT's layout, written here. One engine serves every
row (`--enable-lora`, `--max-loras` = adapters), so the rows differ only in what the
requests name:

- `base`: no request names an adapter (the base model's path, decode graphs included);
- `4 adapters`: the batch split evenly over the adapters (eager steps through the op).

A decode step's time is (time for `steps + 1` tokens - time for 1 token) / steps, best of
3, measured side by side in one process. `--op-only` times `lora_linear` per
implementation on one layer's shapes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

PROJECTIONS = {"self_attn.q_proj": ("hidden", "q"), "self_attn.k_proj": ("hidden", "kv"),
               "self_attn.v_proj": ("hidden", "kv"), "self_attn.o_proj": ("q", "hidden"),
               "mlp.gate_proj": ("hidden", "inter"), "mlp.up_proj": ("hidden", "inter"),
               "mlp.down_proj": ("inter", "hidden")}


def write_adapter(folder: Path, hf: dict, rank: int, seed: int) -> str:
    from safetensors.torch import save_file

    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf["hidden_size"] // heads
    sizes = {"hidden": hf["hidden_size"], "q": heads * head_dim, "kv": kv * head_dim, "inter": hf["intermediate_size"]}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(hf["num_hidden_layers"]):
        for name, (d_in, d_out) in PROJECTIONS.items():
            key = f"base_model.model.model.layers.{i}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, sizes[d_in], generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(sizes[d_out], rank, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": [n.split(".")[-1] for n in PROJECTIONS]}))
    return str(folder)


def step_time(llm, prompts, params_cls, steps: int, loras) -> float:
    def run(max_tokens: int) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     params_cls(max_tokens=max_tokens, temperature=0, ignore_eos=True), lora_request=loras,
                     use_tqdm=False)
        return time.perf_counter() - start

    run(steps + 1)  # warm-up
    best = float("inf")
    for _ in range(3):
        best = min(best, (run(steps + 1) - run(1)) / steps)
    return best


def op_times(rank: int, slots: int, tokens: int) -> list[str]:
    from portaserve.framework.op_references import lora_linear as reference
    from portaserve.framework.plugins import get_registry

    impls = {"reference": reference}
    for _plugin, impl in get_registry().custom_ops:
        if impl.op == "lora_linear" and "cpu" in impl.platforms:
            impls[impl.name] = impl.load()
    rows = []
    for d_in, d_out, label in ((896, 1152 * 1, "qkv"), (896, 9728, "gate_up"), (4864, 896, "down")):
        x = torch.randn(tokens, d_in, dtype=torch.bfloat16)
        y = torch.randn(tokens, d_out, dtype=torch.bfloat16)
        parts = 3 if label == "qkv" else 2 if label == "gate_up" else 1
        a = torch.randn(slots, parts * rank, d_in, dtype=torch.bfloat16) * 0.01
        b = torch.randn(slots, parts * rank, d_out, dtype=torch.bfloat16) * 0.01
        token_slots = torch.arange(tokens) % slots
        cells = []
        for name, fn in impls.items():
            fn(y.clone(), x, a, b, token_slots)
            start = time.perf_counter()
            for _ in range(20):
                fn(y.clone(), x, a, b, token_slots)
            cells.append(f"{name} {(time.perf_counter() - start) / 20 * 1e3:.3f} ms")
        rows.append(f"| {label} {d_in}x{d_out} | " + " | ".join(cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--op-only", action="store_true")
    args = p.parse_args(argv)
    if args.op_only:
        print("| layer | " + " | ".join(["implementation"] * 2) + " |")
        for row in op_times(args.rank, args.adapters, args.batch):
            print(row)
        return 0
    from portaserve import LLM, SamplingParams
    from portaserve.framework.checkpoint import load_hf_config
    from portaserve.framework.lora import LoRARequest
    from portaserve.models.checkpoints import write_checkpoint

    root = Path(tempfile.mkdtemp(prefix="portaserve-lora-bench-"))
    model = write_checkpoint("Qwen2ForCausalLM", "bench", root / "bench", dtype="bfloat16")
    hf = load_hf_config(model)
    adapters = [LoRARequest(f"a{i}", i + 1, write_adapter(root / f"a{i}", hf, args.rank, i))
                for i in range(args.adapters)]
    llm = LLM(model=str(model), dtype="bfloat16", enable_lora=True, max_loras=args.adapters,
              max_lora_rank=args.rank, max_num_seqs=args.batch, max_model_len=256)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 10000, (16,), generator=gen).tolist() for _ in range(args.batch)]
    base = step_time(llm, prompts, SamplingParams, args.steps, None)
    mixed = step_time(llm, prompts, SamplingParams, args.steps, [adapters[i % len(adapters)] for i in range(args.batch)])
    print(f"plan ops: {dict(llm.plan.custom_ops).get('lora_linear')}")
    print("| batch | adapters | rank | base step (ms) | with adapters (ms) | ratio |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.batch} | {args.adapters} | {args.rank} | {base * 1e3:.1f} | {mixed * 1e3:.1f} | {mixed / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
