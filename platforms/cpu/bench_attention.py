"""Micro-benchmark of CPU paged attention: the backend next to the alternatives it was
chosen over. Run: ``OMP_NUM_THREADS=2 python -m portaserve.platforms.cpu.bench_attention``.

Workloads (Qwen2-0.5B attention shape: 14 heads, 2 KV heads, head 64, block 16):
- decode: 64 decodes with contexts 100-300 tokens (the common serving step);
- prefill: 16 prompts of 128 tokens; and a mixed step (one 256-token chunk on a
  256-token cached prefix + 63 decodes).
Times are the median of repeated per-layer calls (one `forward`; metadata separately).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from portaserve.framework.interfaces import AttentionBatch, AttentionSpec
from portaserve.platforms.cpu.attention import CpuPagedAttentionBackend


def _timeit(fn, repeat: int = 30, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def make_batch(backend, query_lens, seq_lens, seed=0):
    """A step with random K/V already in the cache for every context position."""
    gen = torch.Generator().manual_seed(seed)
    bs = backend.block_size
    spec = backend.spec
    nb = [-(-s // bs) for s in seq_lens]
    perm = torch.randperm(sum(nb), generator=gen)
    cache = torch.randn(backend.kv_cache_shape(sum(nb)), generator=gen).to(spec.dtype)
    block_table = torch.zeros(len(seq_lens), max(nb), dtype=torch.int32)
    slots, start = [], 0
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        table = perm[start : start + nb[i]]
        start += nb[i]
        block_table[i, : nb[i]] = table
        pos = torch.arange(sl - ql, sl)
        slots.append(table[pos // bs] * bs + pos % bs)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    n = int(qsl[-1])
    batch = AttentionBatch(
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.cat(slots).to(torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=bs,
        num_actual_tokens=n,
    )
    q = torch.randn(n, spec.num_heads, spec.head_size, generator=gen).to(spec.dtype)
    k = torch.randn(n, spec.num_kv_heads, spec.head_size, generator=gen).to(spec.dtype)
    v = torch.randn(n, spec.num_kv_heads, spec.head_size, generator=gen).to(spec.dtype)
    return batch, cache, q, k, v


# ----- decode alternatives (all after the K/V write; same gathered rows) -----------------


def decode_gather_float_matmul(backend, md, q, table):
    """Gather once, upcast to float32, grouped matmul + softmax (the backend's path for fp32)."""
    nd, hkv, g, d, L = md.num_decodes, backend.num_kv_heads, backend.gqa_ratio, backend.head_size, md.decode_kv_len
    kv = table.index_select(0, md.decode_rows).view(2, nd, hkv, L, d).float()
    s = torch.matmul(q[:nd].reshape(nd, hkv, g, d).float(), kv[0].transpose(-1, -2)).mul_(backend.spec.scale)
    s.add_(md.decode_mask)
    return torch.matmul(torch.softmax(s, -1), kv[1]).view(nd, -1, d)


def decode_gather_native_matmul(backend, md, q, table):
    """Gather once, matmul in the cache dtype, softmax in float32."""
    nd, hkv, g, d, L = md.num_decodes, backend.num_kv_heads, backend.gqa_ratio, backend.head_size, md.decode_kv_len
    kv = table.index_select(0, md.decode_rows).view(2, nd, hkv, L, d)
    s = torch.matmul(q[:nd].reshape(nd, hkv, g, d), kv[0].transpose(-1, -2)).float().mul_(backend.spec.scale)
    s.add_(md.decode_mask)
    p = torch.softmax(s, -1).to(q.dtype)
    return torch.matmul(p, kv[1]).view(nd, -1, d)


def decode_gather_sdpa(backend, md, q, table):
    """Gather once, then one padded SDPA call with a float mask and enable_gqa."""
    nd, hkv, d, L = md.num_decodes, backend.num_kv_heads, backend.head_size, md.decode_kv_len
    kv = table.index_select(0, md.decode_rows).view(2, nd, hkv, L, d)
    qd = q[:nd].unsqueeze(2)  # [nd, heads, 1, d]
    mask = md.decode_mask.to(q.dtype)
    o = F.scaled_dot_product_attention(qd, kv[0], kv[1], attn_mask=mask, scale=backend.spec.scale, enable_gqa=True)
    return o.view(nd, -1, d)


def decode_repeat_kv_bmm(backend, md, q, table):
    """Baseline: repeat K/V per query head (what grouping avoids)."""
    nd, hkv, g, d, L = md.num_decodes, backend.num_kv_heads, backend.gqa_ratio, backend.head_size, md.decode_kv_len
    kv = table.index_select(0, md.decode_rows).view(2, nd, hkv, L, d).float()
    keys = kv[0].repeat_interleave(g, dim=1)
    values = kv[1].repeat_interleave(g, dim=1)
    s = torch.matmul(q[:nd].float().unsqueeze(2), keys.transpose(-1, -2)).mul_(backend.spec.scale)
    s.add_(md.decode_mask)
    return torch.matmul(torch.softmax(s, -1), values).view(nd, -1, d)


def decode_per_seq_sdpa(backend, md, q, table, lens, rows_per_seq):
    """Baseline: a Python loop over sequences with one SDPA each."""
    d, hkv = backend.head_size, backend.num_kv_heads
    outs = []
    for i, (L, rows) in enumerate(zip(lens, rows_per_seq)):
        kv = table.index_select(0, rows).view(2, 1, hkv, L, d)
        outs.append(
            F.scaled_dot_product_attention(q[i : i + 1].unsqueeze(2), kv[0], kv[1], scale=backend.spec.scale, enable_gqa=True)
        )
    return torch.cat(outs).view(len(lens), -1, d)


def bench_decode(dtype, threads: int) -> None:
    spec = AttentionSpec(14, 2, 64, 0.125, dtype)
    backend = CpuPagedAttentionBackend(spec, 16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(100, 301, (64,), generator=gen).tolist()
    batch, cache, q, k, v = make_batch(backend, [1] * 64, lens)
    md = backend.build_metadata(batch)
    table = cache.view(-1, spec.head_size)
    # per-sequence rows for the loop baseline
    rows_per_seq = []
    for i, L in enumerate(lens):
        r = md.decode_rows.view(2, 64, 2, -1)[:, i, :, :L]
        rows_per_seq.append(r.reshape(-1).contiguous())
    ref = decode_gather_float_matmul(backend, md, q, table).float()
    results = {
        "build_metadata": _timeit(lambda: backend.build_metadata(batch)),
        "forward (backend: write + attend)": _timeit(lambda: backend.forward(q, k, v, cache, md)),
        "  write only (2x index_copy_)": _timeit(
            lambda: (table.index_copy_(0, md.write_rows[0], k.reshape(-1, 64)), table.index_copy_(0, md.write_rows[1], v.reshape(-1, 64)))
        ),
        "  gather only (index_select)": _timeit(lambda: table.index_select(0, md.decode_rows)),
    }
    variants = {
        "gather + fp32 grouped matmul": decode_gather_float_matmul,
        "gather + native grouped matmul": decode_gather_native_matmul,
        "gather + padded SDPA (gqa)": decode_gather_sdpa,
        "gather + repeat_kv fp32 matmul": decode_repeat_kv_bmm,
    }
    for name, fn in variants.items():
        err = (fn(backend, md, q, table).float() - ref).norm() / ref.norm()
        results[f"{name} (rel err {err:.1e})"] = _timeit(lambda fn=fn: fn(backend, md, q, table))
    results["loop over seqs, SDPA each"] = _timeit(
        lambda: decode_per_seq_sdpa(backend, md, q, table, lens, rows_per_seq), repeat=10
    )
    kv_bytes = sum(lens) * 2 * 2 * 64 * cache.element_size()
    print(f"\n== decode: 64 seqs, ctx 100-300 (sum {sum(lens)}), 14/2 heads, d64, bs16, {dtype}, {threads} threads; KV read {kv_bytes / 1e6:.1f} MB")
    for name, ms in results.items():
        print(f"  {name:55s} {ms:8.3f} ms")


# ----- prefill alternatives -----------------------------------------------------------------


def bench_prefill(dtype, threads: int) -> None:
    spec = AttentionSpec(14, 2, 64, 0.125, dtype)
    backend = CpuPagedAttentionBackend(spec, 16, torch.device("cpu"))
    print(f"\n== prefill / mixed, 14/2 heads, d64, bs16, {dtype}, {threads} threads")
    for label, qls, sls in (
        ("16 prompts x 128 tokens", [128] * 16, [128] * 16),
        ("1 prompt x 1024 tokens", [1024], [1024]),
        ("256-token chunk on 256 cached + 63 decodes", [1] * 63 + [256], [200] * 63 + [512]),
    ):
        batch, cache, q, k, v = make_batch(backend, qls, sls)
        md = backend.build_metadata(batch)
        t_md = _timeit(lambda: backend.build_metadata(batch), repeat=10)
        t_fwd = _timeit(lambda: backend.forward(q, k, v, cache, md), repeat=10)
        print(f"  {label:45s} metadata {t_md:7.3f} ms   forward {t_fwd:8.3f} ms")
        if len(set(qls)) == 1 and qls[0] == sls[0] and len(qls) > 1:
            # alternative: one batched causal SDPA over the equal-length prompts
            n, ql = len(qls), qls[0]
            qb = q.view(n, ql, 14, 64).transpose(1, 2)
            kb = k.view(n, ql, 2, 64).transpose(1, 2)
            vb = v.view(n, ql, 2, 64).transpose(1, 2)
            t_b = _timeit(
                lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=0.125, enable_gqa=True), repeat=10
            )
            print(f"  {'  alt: one batched causal SDPA (no gather)':45s} {'':21s} {t_b:8.3f} ms")


def bench_encoder(dtype, threads: int) -> None:
    spec = AttentionSpec(12, 12, 64, 0.125, dtype, causal=False)
    backend = CpuPagedAttentionBackend(spec, 16, torch.device("cpu"))
    print(f"\n== encoder (BERT-base shape 12 heads d64), {dtype}, {threads} threads")
    for label, lens in (("32 x 128 tokens (equal)", [128] * 32), ("32 seqs, 16-128 tokens", list(range(16, 129, 4))[:32])):
        n = sum(lens)
        qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
        batch = AttentionBatch(qsl, torch.tensor(lens, dtype=torch.int32), torch.zeros(len(lens), 1, dtype=torch.int32),
                               torch.zeros(n, dtype=torch.int64), max(lens), max(lens), 16, n)
        q, k, v = (torch.randn(n, 12, 64).to(dtype) for _ in range(3))
        md = backend.build_metadata(batch)
        t = _timeit(lambda: backend.forward(q, k, v, None, md), repeat=10)
        print(f"  {label:45s} forward {t:8.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=["decode", "prefill", "encoder"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            if args.only in (None, "decode"):
                bench_decode(dtype, args.threads)
            if args.only in (None, "prefill"):
                bench_prefill(dtype, args.threads)
            if args.only in (None, "encoder"):
                bench_encoder(dtype, args.threads)


if __name__ == "__main__":
    main()
