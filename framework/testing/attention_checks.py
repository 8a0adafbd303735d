"""Backend-generic attention checks: any `AttentionBackend` class on any device.

Each `AttentionCase` is a small multi-step scenario (a few sequences, each with a
schedule of how many new tokens it brings at every step: prefill chunks, then decodes).
`run_case` drives the backend through it exactly as the model runner would (host
`AttentionBatch` -> `build_metadata` -> `forward`) and compares every step's output with
`reference_attention`, a float64 torch reference written with explicit loops over
sequences and explicit masks over dense per-sequence K/V copies.

What makes the checks able to fail:
- the KV cache starts filled with NaN, so a backend that reads any slot it was never
  given (padding past a context, the unused part of a partly filled block, a block of
  another sequence) produces NaN;
- block ids are shuffled (no sequence owns contiguous blocks) and some blocks stay unused;
- after every step, each block must hold exactly as many non-NaN values as the tokens
  written into it so far (block ids index the backend's declared `kv_cache_block_dim`,
  checked against `kv_cache_shape` first, :mod:`.kv_layout`; the layout inside a block
  is the backend's business);
- padding tokens past `num_actual_tokens` carry a slot of a live token: writing them
  would corrupt that token and show in the output;
- one scenario shares prefix blocks between two sequences of the same batch, written by
  one and read by the other in the same step (write-before-attend contract).

An fp8 KV cache (`kv_cache_dtype="fp8"`) is checked against the reference run on K/V
rounded through the cache's dtype, within `FP8_KV_TOLERANCE` (a backend may scale
before rounding).

Capabilities are respected: a case whose spec or block size the backend declares
unsupported (`unsupported_reason`) is skipped with that reason, never failed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from portaserve.framework.interfaces import AttentionBackend, AttentionBatch, AttentionSpec
from portaserve.framework.testing.kv_layout import blocks_view, check_kv_layout, is_fp8

#: ‖out − ref‖ / ‖ref‖ allowed per dtype.
TOLERANCES: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
#: ... with an fp8 KV cache, against the reference on K/V rounded to fp8 (unscaled): a
#: backend that scales before rounding rounds differently, by up to a few percent.
FP8_KV_TOLERANCE = 5e-2


@dataclass(frozen=True, slots=True)
class AttentionCase:
    """One scenario. `steps[s][i]` = new tokens of sequence i at step s (0: not scheduled)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    steps: tuple[tuple[int, ...], ...]
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    causal: bool = True
    #: (reader, writer, num_blocks): the reader's first blocks are the writer's, and the
    #: reader starts with that many tokens already computed (written by the writer in the
    #: reader's first step).
    shared_prefix: tuple[int, int, int] | None = None
    #: extra tokens past num_actual_tokens in the given steps (static-shape padding)
    padding: tuple[int, ...] = ()
    num_padding_tokens: int = 3
    #: order in which sequences appear in each step's batch (default: 0, 1, ...)
    order: tuple[int, ...] | None = None
    seed: int = 0
    #: "auto" (the cache holds `dtype`) or "fp8"
    kv_cache_dtype: str = "auto"

    def spec(self) -> AttentionSpec:
        # A scale that is not 1/sqrt(head_size), so a backend ignoring spec.scale fails.
        return AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            scale=1.3 / math.sqrt(self.head_size),
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
            sliding_window=self.sliding_window,
            causal=self.causal,
            logits_soft_cap=self.logits_soft_cap,
        )

    def unsupported_reason(self, backend_cls: type[AttentionBackend]) -> str | None:
        return backend_cls.unsupported_reason(self.spec(), self.block_size)

    @property
    def num_seqs(self) -> int:
        return len(self.steps[0])

    def final_lens(self) -> list[int]:
        lens = [sum(step[i] for step in self.steps) for i in range(self.num_seqs)]
        if self.shared_prefix is not None:
            reader, _writer, nb = self.shared_prefix
            lens[reader] += nb * self.block_size
        return lens


# ----- the reference ---------------------------------------------------------------------


def reference_attention(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    query_lens: Sequence[int],
    spec: AttentionSpec,
) -> torch.Tensor:
    """Plain float64 attention, one sequence at a time.

    :param q: [num_tokens, num_heads, head_size], the new tokens of every sequence in order
    :param keys: per sequence [seq_len, num_kv_heads, head_size], its whole context (new tokens last)
    :param values: same shapes as keys
    :param query_lens: new tokens per sequence
    :returns: [num_tokens, num_heads, head_size] float64
    """
    out = []
    start = 0
    ratio = spec.num_heads // spec.num_kv_heads
    for key, value, qlen in zip(keys, values, query_lens, strict=True):
        seq_len = key.shape[0]
        qs = q[start : start + qlen].double().transpose(0, 1)  # [heads, qlen, d]
        start += qlen
        # kv head j serves query heads j*ratio .. (j+1)*ratio - 1 (transformers' repeat_kv)
        ks = key.double().repeat_interleave(ratio, dim=1).transpose(0, 1)  # [heads, seq_len, d]
        vs = value.double().repeat_interleave(ratio, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * spec.scale  # [heads, qlen, seq_len]
        if spec.logits_soft_cap is not None:
            scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
        allowed = torch.ones(qlen, seq_len, dtype=torch.bool)
        if spec.causal:
            for i in range(qlen):
                pos = seq_len - qlen + i
                allowed[i, pos + 1 :] = False
                if spec.sliding_window is not None:
                    # transformers' sliding_window_overlay: kv_idx > q_idx - sliding_window
                    allowed[i, : max(0, pos - spec.sliding_window + 1)] = False
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append((torch.softmax(scores, dim=-1) @ vs).transpose(0, 1))
    return torch.cat(out) if out else q.new_zeros((0,) + q.shape[1:], dtype=torch.float64)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (inf when out has a NaN)."""
    diff = (out.double().cpu() - ref.double().cpu()).norm()
    err = float(diff / ref.double().cpu().norm().clamp_min(1e-30))
    return err if math.isfinite(err) else math.inf


# ----- running one case -------------------------------------------------------------------


@dataclass(slots=True)
class CaseResult:
    name: str
    skipped: str | None = None  # the backend's reason, when skipped
    errors: list[float] = field(default_factory=list)  # relative error per step


def run_case(backend_cls: type[AttentionBackend], case: AttentionCase, device: torch.device | str) -> CaseResult:
    """Drive `backend_cls` through `case` on `device`; raises AssertionError on a mismatch."""
    device = torch.device(device)
    reason = case.unsupported_reason(backend_cls)
    if reason is not None:
        return CaseResult(case.name, skipped=reason)
    spec = case.spec()
    backend = backend_cls(spec, case.block_size, device)
    if not case.causal:
        return _run_encoder(backend, case, device)

    gen = torch.Generator().manual_seed(case.seed)
    bs = case.block_size
    lens = case.final_lens()
    num_seqs = case.num_seqs
    hkv, d = case.num_kv_heads, case.head_size

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(case.dtype)

    dense_k = [rand(n, hkv, d) for n in lens]
    dense_v = [rand(n, hkv, d) for n in lens]
    dense_q = [rand(n, case.num_heads, d) for n in lens]
    computed = [0] * num_seqs

    # Shuffled block ids with a few blocks left unused (they must stay NaN).
    blocks_needed = [-(-n // bs) for n in lens]
    shared_reader = shared_writer = shared_blocks = None
    if case.shared_prefix is not None:
        shared_reader, shared_writer, shared_blocks = case.shared_prefix
        dense_k[shared_reader][: shared_blocks * bs] = dense_k[shared_writer][: shared_blocks * bs]
        dense_v[shared_reader][: shared_blocks * bs] = dense_v[shared_writer][: shared_blocks * bs]
        blocks_needed[shared_reader] -= shared_blocks
    num_blocks = sum(blocks_needed) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables: list[list[int]] = []
    for i in range(num_seqs):
        tables.append([pool.pop() for _ in range(blocks_needed[i])])
    if shared_reader is not None:
        tables[shared_reader] = tables[shared_writer][:shared_blocks] + tables[shared_reader]
    max_blocks = max(len(t) for t in tables)

    block_dim = check_kv_layout(backend, num_blocks)
    cache = torch.full(backend.kv_cache_shape(num_blocks), float("nan"), dtype=backend.kv_cache_torch_dtype())
    cache = cache.to(device)
    per_block_numel = blocks_view(cache, block_dim)[0].numel()
    dense_block = per_block_numel == 2 * bs * hkv * d
    written: set[tuple[int, int]] = set()  # (block, offset) slots written so far

    result = CaseResult(case.name)
    tol = TOLERANCES.get(case.dtype, 1e-2)
    if is_fp8(cache.dtype):
        # The reference attends over what the cache can hold: K/V rounded to its dtype.
        ref_k = [t.to(cache.dtype).to(case.dtype) for t in dense_k]
        ref_v = [t.to(cache.dtype).to(case.dtype) for t in dense_v]
        tol = max(tol, FP8_KV_TOLERANCE)
    else:
        ref_k, ref_v = dense_k, dense_v
    order = list(case.order) if case.order is not None else list(range(num_seqs))
    for step_idx, step in enumerate(case.steps):
        seqs = [i for i in order if step[i] > 0]
        if shared_reader is not None and shared_reader in seqs and computed[shared_reader] == 0:
            computed[shared_reader] = shared_blocks * bs
        q_chunks, k_chunks, v_chunks, slots, qlens, slens = [], [], [], [], [], []
        for i in seqs:
            a, b = computed[i], computed[i] + step[i]
            q_chunks.append(dense_q[i][a:b])
            k_chunks.append(dense_k[i][a:b])
            v_chunks.append(dense_v[i][a:b])
            pos = torch.arange(a, b)
            table = torch.tensor(tables[i], dtype=torch.int64)
            slots.append(table[pos // bs] * bs + pos % bs)
            qlens.append(b - a)
            slens.append(b)
        num_actual = sum(qlens)
        num_pad = case.num_padding_tokens if step_idx in case.padding else 0
        q = torch.cat(q_chunks + [rand(num_pad, case.num_heads, d)])
        k = torch.cat(k_chunks + [rand(num_pad, hkv, d)])
        v = torch.cat(v_chunks + [rand(num_pad, hkv, d)])
        # Padding points at the slot of a live token: a backend that writes it corrupts that token.
        slot_mapping = torch.cat(slots + [slots[0][:1].expand(num_pad)])
        block_table = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
        for row, i in enumerate(seqs):
            block_table[row, : len(tables[i])] = torch.tensor(tables[i], dtype=torch.int32)
        qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
        batch = AttentionBatch(
            query_start_loc=qsl,
            seq_lens=torch.tensor(slens, dtype=torch.int32),
            block_table=block_table,
            slot_mapping=slot_mapping.to(torch.int64),
            max_query_len=max(qlens),
            max_seq_len=max(slens),
            block_size=bs,
            num_actual_tokens=num_actual,
        )
        metadata = backend.build_metadata(batch)
        out = backend.forward(q.to(device), k.to(device), v.to(device), cache, metadata)
        if tuple(out.shape) != tuple(q.shape):
            raise AssertionError(f"{case.name} step {step_idx}: output shape {tuple(out.shape)}, expected {tuple(q.shape)}")

        keys = [ref_k[i][: slens[r]] for r, i in enumerate(seqs)]
        values = [ref_v[i][: slens[r]] for r, i in enumerate(seqs)]
        ref = reference_attention(q[:num_actual], keys, values, qlens, spec)
        err = relative_error(out[:num_actual], ref)
        result.errors.append(err)
        if not err <= tol:
            raise AssertionError(
                f"{backend_cls.name} {case.name} step {step_idx}: relative error {err:.3g} > {tol:g} "
                f"(query_lens {qlens}, seq_lens {slens})"
            )
        for s in slot_mapping[:num_actual].tolist():
            written.add((s // bs, s % bs))
        _check_blocks(backend_cls.name, case.name, step_idx, blocks_view(cache, block_dim), written, dense_block, 2 * hkv * d)
        for i, n in zip(seqs, qlens):
            computed[i] += n
    return result


def _check_blocks(backend, case, step_idx, blocks, written, dense_block, per_token) -> None:
    """Each block holds non-NaN values for exactly the slots written into it.

    :param blocks: the cache viewed block-major (`blocks_view`), whatever its layout.
    """
    finite = (~torch.isnan(blocks.float())).reshape(blocks.shape[0], -1).sum(dim=1).cpu()
    expected = torch.zeros_like(finite)
    for block, _offset in written:
        expected[block] += per_token
    for block in range(blocks.shape[0]):
        got, want = int(finite[block]), int(expected[block])
        bad = got != want if dense_block else (want == 0 and got != 0)
        if bad:
            raise AssertionError(
                f"{backend} {case} step {step_idx}: block {block} holds {got} written values, expected {want} "
                "(new K/V written to the wrong slots, or padding tokens written)"
            )


def _run_encoder(backend: AttentionBackend, case: AttentionCase, device: torch.device) -> CaseResult:
    gen = torch.Generator().manual_seed(case.seed)
    spec = case.spec()
    result = CaseResult(case.name)
    tol = TOLERANCES.get(case.dtype, 1e-2)
    for step_idx, step in enumerate(case.steps):
        qlens = [n for n in step if n > 0]
        num_tokens = sum(qlens)
        q = torch.randn(num_tokens, case.num_heads, case.head_size, generator=gen).to(case.dtype)
        k = torch.randn(num_tokens, case.num_kv_heads, case.head_size, generator=gen).to(case.dtype)
        v = torch.randn(num_tokens, case.num_kv_heads, case.head_size, generator=gen).to(case.dtype)
        qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
        batch = AttentionBatch(
            query_start_loc=qsl,
            seq_lens=torch.tensor(qlens, dtype=torch.int32),
            block_table=torch.zeros(len(qlens), 1, dtype=torch.int32),
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
            max_query_len=max(qlens),
            max_seq_len=max(qlens),
            block_size=case.block_size,
            num_actual_tokens=num_tokens,
        )
        metadata = backend.build_metadata(batch)
        out = backend.forward(q.to(device), k.to(device), v.to(device), None, metadata)
        bounds = qsl.tolist()
        keys = [k[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        values = [v[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        ref = reference_attention(q, keys, values, qlens, spec)
        err = relative_error(out, ref)
        result.errors.append(err)
        if not err <= tol:
            raise AssertionError(f"{backend.name} {case.name} step {step_idx}: relative error {err:.3g} > {tol:g}")
    return result


# ----- the grid ---------------------------------------------------------------------------

#: (num_heads, num_kv_heads): GQA ratios 1, 4, 8 and MQA
HEAD_CONFIGS = ((4, 4), (8, 2), (16, 2), (4, 1))


def mixed_steps(bs: int) -> tuple[tuple[int, ...], ...]:
    """Five sequences; the last step mixes decodes of different lengths, prefill chunks on
    top of a cached prefix (one crossing a block boundary), and a fresh prefill. Lengths
    are not multiples of the block size, so the last blocks are partly filled."""
    return (
        (bs + 3, 5, 2 * bs - 1, 0, 1),  # prefills (one of a single token)
        (1, bs + 2, 1, 0, bs // 2 + 1),  # decodes + chunks on cached prefixes
        (1, 1, bs, bs + 5, 1),  # the final mix: decodes, a chunk with a prefix, a fresh prefill
    )


def default_cases(
    backend_cls: type[AttentionBackend],
    dtype: torch.dtype,
    *,
    head_sizes: Sequence[int] = (64, 128),
    block_sizes: Sequence[int] = (16, 32),
) -> Iterator[AttentionCase]:
    """The conformance grid for one dtype (block sizes fall back to the backend's own)."""
    supported = sorted(backend_cls.supported_block_sizes)
    sizes = [b for b in block_sizes if b in supported] or supported[:2]
    dname = str(dtype).removeprefix("torch.")
    for bs in sizes:
        for hs in head_sizes:
            for h, hkv in HEAD_CONFIGS:
                yield AttentionCase(f"mixed-{dname}-bs{bs}-d{hs}-h{h}kv{hkv}", h, hkv, hs, bs, dtype, mixed_steps(bs))
    bs, hs = sizes[0], head_sizes[0]
    base = AttentionCase("", 8, 2, hs, bs, dtype, mixed_steps(bs))
    yield replace(base, name=f"order-{dname}", order=(4, 1, 0, 3, 2), seed=1)
    yield replace(base, name=f"padding-{dname}", padding=(0, 1, 2), seed=2)
    for window in (1, 5, bs + 1, 4 * bs):
        yield replace(base, name=f"window{window}-{dname}", sliding_window=window, seed=3)
    yield replace(base, name=f"softcap-{dname}", logits_soft_cap=2.0, seed=4)
    yield replace(base, name=f"softcap-window-{dname}", logits_soft_cap=2.0, sliding_window=7, seed=5)
    # long decodes only: the common serving step
    yield replace(base, name=f"decodes-{dname}", steps=((3 * bs + 1, 40, 1, 2 * bs), (1, 1, 1, 1), (1, 1, 1, 1)), seed=6)
    # equal-length prompts in a row (a backend may batch them), then equal-length decodes
    yield replace(base, name=f"equal-prompts-{dname}", steps=((bs + 4, bs + 4, bs + 4, 9), (1, 1, 1, 1), (1, 1, 1, 0)), seed=9)
    yield replace(
        base, name=f"equal-prompts-window-{dname}", steps=((bs + 4, bs + 4, 9), (1, 1, 1)), sliding_window=6, seed=10
    )
    # equal-length prompts separated by a decode / a chunk on a cached prefix
    yield replace(
        base, name=f"split-prompts-{dname}", steps=((0, 3, 0, 4, 0), (bs + 4, 1, bs + 4, 5, bs + 4), (1, 1, 1, 1, 1)), seed=11
    )
    # seq 1 reads 2 blocks that seq 0 writes in the same step
    yield replace(
        base,
        name=f"shared-prefix-{dname}",
        steps=((2 * bs + 3, 3), (1, 1)),
        shared_prefix=(1, 0, 2),
        seed=7,
    )
    for h, hkv in ((4, 4), (8, 2)):
        yield AttentionCase(
            f"encoder-{dname}-h{h}kv{hkv}", h, hkv, hs, bs, dtype, ((7, 1, 19), (5, 5)), causal=False, seed=8
        )


def check_backend(
    backend_cls: type[AttentionBackend],
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    head_sizes: Sequence[int] = (64, 128),
    block_sizes: Sequence[int] = (16, 32),
) -> list[CaseResult]:
    """Run the whole grid for `backend_cls`; raises AssertionError at the first failure.

    Combinations the backend does not declare (dtype, head size, block size, sliding
    window, encoder, GQA ratio) come back as skipped results with its reason.
    """
    if dtype not in backend_cls.supported_dtypes:
        return [CaseResult(f"all-{dtype}", skipped=f"dtype {dtype} not declared")]
    return [
        run_case(backend_cls, case, device)
        for case in default_cases(backend_cls, dtype, head_sizes=head_sizes, block_sizes=block_sizes)
    ]
