"""Micro-benchmark of CPU paged attention: the backend next to the alternatives it was
chosen over. Run: ``OMP_NUM_THREADS=2 python -m portaserve.platforms.cpu.bench_attention``.

Workloads (Qwen2-0.5B attention shape: 14 heads, 2 KV heads, head 64, block 16):
- decode: 64 decodes with contexts 100-300 tokens (the common serving step);
- prefill: 16 prompts of 128 tokens, one of 1024, and a mixed step (a 256-token chunk
  on a 256-token cached prefix + 63 decodes);
- encoder: BERT-base shape (12 heads, head 64), equal and varied lengths.
Alternatives are timed in interleaved rounds; each number is the fastest single call
(ms per layer call): on a shared 2-core machine the minimum is what stays comparable
while other processes come and go (`--median` prints the best round's median instead).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from portaserve.framework.interfaces import AttentionBatch, AttentionSpec
from portaserve.platforms.cpu.attention import CpuPagedAttentionBackend
from portaserve.platforms.cpu import native as native_kernels


USE_MEDIAN = False
#: time.perf_counter (wall) by default; time.thread_time with --cpu-time (1 thread), which
#: other processes competing for the cores do not inflate.
CLOCK = time.perf_counter


def compare(fns: dict[str, Callable[[], object]], rounds: int = 5, repeat: int = 10) -> dict[str, float]:
    """Fastest call (or best round median, with --median) in ms of each function, rounds interleaved."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            times = []
            for _ in range(repeat):
                t0 = CLOCK()
                fn()
                times.append(CLOCK() - t0)
            best[name] = min(best[name], (statistics.median(times) if USE_MEDIAN else min(times)) * 1e3)
    return best


def _print(results: dict[str, float]) -> None:
    for name, ms in results.items():
        print(f"  {name:58s} {ms:8.3f} ms")


class TorchDecodes(CpuPagedAttentionBackend):
    """The backend with its C decode kernel off (the SDPA decode path)."""

    def __init__(self, spec, block_size, device):
        super().__init__(spec, block_size, device)
        self._native = None


def _with_groups(tokens: int) -> type[CpuPagedAttentionBackend]:
    return type(f"Groups{tokens}", (TorchDecodes,), {"decode_group_tokens": tokens})


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


# ----- decode alternatives, on one padded group (the gathered rows are the backend's) --------


def _one_group(backend, batch):
    md = _with_groups(1 << 30)(backend.spec, backend.block_size, backend.device).build_metadata(batch)
    (group,) = md.decode_groups
    return group


def _additive_mask(g):
    """The group's boolean padding mask as 0 / -inf float32 (0 when it has none)."""
    if g.mask is None:
        return 0.0
    return torch.zeros(g.mask.shape).masked_fill_(~g.mask, float("-inf"))


def decode_float32_matmul(backend, g, q, table):
    """float32 upcast of K/V, grouped matmuls, softmax in float32 (the default before SDPA)."""
    n, hkv, r, d, L = g.num_seqs, backend.num_kv_heads, backend.gqa_ratio, backend.head_size, g.kv_len
    kv = table.index_select(0, g.rows).view(2, n, hkv, L, d).float()
    qd = q.index_select(0, g.token_idx).view(n, hkv, r, d).float() * backend.spec.scale
    s = torch.matmul(qd, kv[0].transpose(-1, -2)) + _additive_mask(g)
    return torch.matmul(torch.softmax(s, -1), kv[1]).view(n, -1, d).to(q.dtype)


def decode_native_matmul(backend, g, q, table):
    """Grouped matmul in the cache dtype (no float32 copy of K/V), softmax in float32."""
    n, hkv, r, d, L = g.num_seqs, backend.num_kv_heads, backend.gqa_ratio, backend.head_size, g.kv_len
    kv = table.index_select(0, g.rows).view(2, n, hkv, L, d)
    qd = q.index_select(0, g.token_idx).view(n, hkv, r, d) * backend.spec.scale
    s = torch.matmul(qd, kv[0].transpose(-1, -2)).float() + _additive_mask(g)
    return torch.matmul(torch.softmax(s, -1).to(q.dtype), kv[1]).view(n, -1, d)


def decode_padded_sdpa(backend, g, q, table):
    """One padded SDPA call (float mask, enable_gqa) in the cache dtype."""
    n, hkv, d, L = g.num_seqs, backend.num_kv_heads, backend.head_size, g.kv_len
    kv = table.index_select(0, g.rows).view(2, n, hkv, L, d)
    qd = q.index_select(0, g.token_idx).unsqueeze(2)  # [n, heads, 1, d]
    mask = None if g.mask is None else g.mask.view(n, 1, 1, L)
    o = F.scaled_dot_product_attention(qd, kv[0], kv[1], attn_mask=mask, scale=backend.spec.scale, enable_gqa=True)
    return o.view(n, -1, d)


def decode_repeat_kv(backend, g, q, table):
    """float32 matmul with K/V repeated per query head (what grouping query heads avoids)."""
    n, hkv, r, d, L = g.num_seqs, backend.num_kv_heads, backend.gqa_ratio, backend.head_size, g.kv_len
    kv = table.index_select(0, g.rows).view(2, n, hkv, L, d).float()
    keys, values = kv[0].repeat_interleave(r, dim=1), kv[1].repeat_interleave(r, dim=1)
    qd = q.index_select(0, g.token_idx).float().unsqueeze(2) * backend.spec.scale
    s = torch.matmul(qd, keys.transpose(-1, -2)) + _additive_mask(g)
    return torch.matmul(torch.softmax(s, -1), values).view(n, -1, d)


def decode_seq_loop(backend, q, table, lens, rows_per_seq):
    """A Python loop over sequences, one unpadded SDPA each."""
    d, hkv = backend.head_size, backend.num_kv_heads
    outs = []
    for i, (L, rows) in enumerate(zip(lens, rows_per_seq)):
        kv = table.index_select(0, rows).view(2, 1, hkv, L, d)
        qi = q[i : i + 1].unsqueeze(2)
        outs.append(F.scaled_dot_product_attention(qi, kv[0], kv[1], scale=backend.spec.scale, enable_gqa=True))
    return torch.cat(outs).view(len(lens), -1, d)


def bench_decode(dtype) -> None:
    spec = AttentionSpec(14, 2, 64, 0.125, dtype)
    backend = CpuPagedAttentionBackend(spec, 16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(100, 301, (64,), generator=gen).tolist()
    batch, cache, q, k, v = make_batch(backend, [1] * 64, lens)
    table = cache.view(-1, spec.head_size)
    kv_bytes = sum(lens) * 2 * 2 * 64 * cache.element_size()
    print(f"\n== decode: 64 seqs, ctx 100-300 (sum {sum(lens)}), 14/2 heads, d64, bs16, {dtype}; KV {kv_bytes / 1e6:.1f} MB")

    fns: dict[str, Callable] = {}
    if backend._native is not None:
        native_md = backend.build_metadata(batch)
        fns["build_metadata, C kernel"] = lambda b=backend: b.build_metadata(batch)
        fns["forward, C kernel (default)"] = lambda b=backend: b.forward(q, k, v, cache, native_md)
        for part_len in (128, 256, 1024):
            b = type(f"Parts{part_len}", (CpuPagedAttentionBackend,), {"native_part_len": part_len})(spec, 16, backend.device)
            m = b.build_metadata(batch)
            fns[f"forward, C kernel, parts of {part_len} keys"] = lambda b=b, m=m: b.forward(q, k, v, cache, m)
    else:
        print(f"  (no C kernel: {native_kernels.unavailable_reason()})")
    backend = TorchDecodes(spec, 16, backend.device)
    md = backend.build_metadata(batch)
    fns["build_metadata, torch path"] = lambda b=backend: b.build_metadata(batch)
    for tokens in (1 << 30, 8192, 4096, 3072, 2048, 1024):
        b = _with_groups(tokens)(spec, 16, backend.device)
        m = b.build_metadata(batch)
        label = "one group" if tokens == 1 << 30 else f"groups of <= {tokens} keys"
        default = " (torch path)" if tokens == backend.decode_group_tokens else ""
        fns[f"forward, {label} ({len(m.decode_groups)}){default}"] = lambda b=b, m=m: b.forward(q, k, v, cache, m)
    fns["  of which: write (2 x index_copy_)"] = lambda: (
        table.index_copy_(0, md.write_rows[0], k.reshape(-1, 64)),
        table.index_copy_(0, md.write_rows[1], v.reshape(-1, 64)),
    )
    fns["  of which: gather (index_select per group)"] = lambda: [table.index_select(0, g.rows) for g in md.decode_groups]
    # about the same bytes gathered as whole [block_size, head_size] chunks (the cost of the read
    # alone; the backend would also need padding to whole blocks and zeroing their unwritten tails)
    chunk_ids = [g.rows[::16] // 16 for g in md.decode_groups]
    chunks = table.view(-1, 16 * 64)
    fns["  gather as whole block chunks instead (rejected)"] = lambda: [chunks.index_select(0, c) for c in chunk_ids]
    # The same gather if the layout were token-major, [num_blocks, 2, block_size, num_kv_heads, head_size]
    bs, hkv = backend.block_size, spec.num_kv_heads

    def token_major(rows):
        offset, head, block_kv = rows % bs, (rows // bs) % hkv, rows // (bs * hkv)
        return (block_kv * bs + offset) * hkv + head

    tm_rows = [token_major(g.rows) for g in md.decode_groups]
    fns["  gather key rows if the layout were token-major (rejected)"] = lambda: [table.index_select(0, r) for r in tm_rows]
    _print(compare(fns))

    g = _one_group(backend, batch)
    ref = backend.forward(q, k, v, cache, md).float()
    order = g.token_idx
    rows4 = g.rows.view(2, g.num_seqs, 2, g.kv_len)
    glens = [lens[int(i)] for i in order]
    rows_per_seq = [rows4[:, i, :, :L].reshape(-1).contiguous() for i, L in enumerate(glens)]
    q_sorted = q.index_select(0, order)
    alts = {
        "alt, one group: float32 upcast + matmuls": lambda: decode_float32_matmul(backend, g, q, table),
        "alt, one group: matmul in cache dtype": lambda: decode_native_matmul(backend, g, q, table),
        "alt, one group: padded SDPA (enable_gqa)": lambda: decode_padded_sdpa(backend, g, q, table),
        "alt, one group: float32 matmul, repeated K/V": lambda: decode_repeat_kv(backend, g, q, table),
        "alt: loop over sequences, SDPA each": lambda: decode_seq_loop(backend, q_sorted, table, glens, rows_per_seq),
    }
    results = compare(alts, rounds=3, repeat=5)
    for name, fn in alts.items():
        out = fn().float()
        out = torch.empty_like(out).index_copy_(0, order, out)
        err = float((out - ref).norm() / ref.norm())
        print(f"  {name:58s} {results[name]:8.3f} ms  (rel. diff {err:.1e})")


# ----- prefill alternatives ------------------------------------------------------------------


def bench_prefill(dtype) -> None:
    spec = AttentionSpec(14, 2, 64, 0.125, dtype)
    backend = CpuPagedAttentionBackend(spec, 16, torch.device("cpu"))
    print(f"\n== prefill / mixed, 14/2 heads, d64, bs16, {dtype}")
    for label, qls, sls in (
        ("16 prompts x 128", [128] * 16, [128] * 16),
        ("1 prompt x 1024", [1024], [1024]),
        ("256 chunk on 256 cached + 63 decodes", [1] * 63 + [256], [200] * 63 + [512]),
    ):
        batch, cache, q, k, v = make_batch(backend, qls, sls)
        md = backend.build_metadata(batch)
        fns: dict[str, Callable] = {
            f"{label}: build_metadata": lambda: backend.build_metadata(batch),
            f"{label}: forward (backend)": lambda: backend.forward(q, k, v, cache, md),
        }
        n, ql = len(qls), qls[-1]
        if qls[0] == sls[0]:
            qb = q.view(n, ql, 14, 64).transpose(1, 2)
            kb = k.view(n, ql, 2, 64).transpose(1, 2)
            vb = v.view(n, ql, 2, 64).transpose(1, 2)
            sdpa = F.scaled_dot_product_attention
            fns[f"{label}: alt SDPA float32 upcast"] = lambda: sdpa(
                qb.float(), kb.float(), vb.float(), is_causal=True, scale=0.125, enable_gqa=True
            )
            fns[f"{label}: alt SDPA contiguous inputs"] = lambda: sdpa(
                qb.contiguous(), kb.contiguous(), vb.contiguous(), is_causal=True, scale=0.125, enable_gqa=True
            )
            fns[f"{label}: alt SDPA with K/V repeated per head"] = lambda: sdpa(
                qb, kb.repeat_interleave(7, 1), vb.repeat_interleave(7, 1), is_causal=True, scale=0.125
            )
            mask = torch.ones(ql, ql, dtype=torch.bool).tril()
            fns[f"{label}: alt SDPA with an explicit causal mask"] = lambda: sdpa(
                qb, kb, vb, attn_mask=mask, scale=0.125, enable_gqa=True
            )
            if n > 1:
                fns[f"{label}: alt loop over prompts"] = lambda: [
                    sdpa(qb[i : i + 1], kb[i : i + 1], vb[i : i + 1], is_causal=True, scale=0.125, enable_gqa=True)
                    for i in range(n)
                ]
        _print(compare(fns, rounds=3, repeat=3))


def bench_encoder(dtype) -> None:
    spec = AttentionSpec(12, 12, 64, 0.125, dtype, causal=False)
    backend = CpuPagedAttentionBackend(spec, 16, torch.device("cpu"))
    print(f"\n== encoder (BERT-base: 12 heads, d64), {dtype}")
    for label, lens in (("32 x 128 (equal)", [128] * 32), ("32 seqs of 16..140", list(range(16, 144, 4)))):
        n = sum(lens)
        qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
        batch = AttentionBatch(
            qsl,
            torch.tensor(lens, dtype=torch.int32),
            torch.zeros(len(lens), 1, dtype=torch.int32),
            torch.zeros(n, dtype=torch.int64),
            max(lens),
            max(lens),
            16,
            n,
        )
        q, k, v = (torch.randn(n, 12, 64).to(dtype) for _ in range(3))
        md = backend.build_metadata(batch)
        fns: dict[str, Callable] = {
            f"{label}: forward (backend)": lambda: backend.forward(q, k, v, None, md),
        }
        if len(set(lens)) > 1:
            # alternative: pad into one batch with a key-padding mask
            width = max(lens)
            seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
            offs = torch.arange(n) - qsl[:-1].long()[seq]
            valid = torch.arange(width) < torch.tensor(lens).unsqueeze(1)
            mask = valid[:, None, None, :]

            def padded():
                buf = q.new_zeros(3, len(lens), width, 12, 64)
                buf[:, seq, offs] = torch.stack([q, k, v])
                o = F.scaled_dot_product_attention(*(buf[i].transpose(1, 2) for i in range(3)), attn_mask=mask, scale=0.125)
                return o.transpose(1, 2)[seq, offs]

            fns[f"{label}: alt padded batch + key mask"] = padded
        _print(compare(fns, rounds=3, repeat=3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=["decode", "prefill", "encoder"], default=None)
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], action="append")
    parser.add_argument("--median", action="store_true", help="report best round medians, not minima")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time with the thread's CPU clock (forces 1 thread): robust on a busy machine"
    )
    args = parser.parse_args()
    global USE_MEDIAN, CLOCK
    USE_MEDIAN = args.median
    if args.cpu_time:
        CLOCK = time.thread_time
        args.threads = 1
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d) for d in (args.dtype or ["bfloat16", "float32"])]
    clock = "thread CPU time" if args.cpu_time else "wall time"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, {clock}")
    with torch.inference_mode():
        for dtype in dtypes:
            if args.only in (None, "decode"):
                bench_decode(dtype)
            if args.only in (None, "prefill"):
                bench_prefill(dtype)
            if args.only in (None, "encoder"):
                bench_encoder(dtype)


if __name__ == "__main__":
    main()
