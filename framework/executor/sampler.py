"""The sampler: one call per step on the logits of the rows that sample.

Everything runs on batched tensors; the only Python loops over rows are the user
logits processors (one call per row that has them). The row parameters come from
`SamplingState.make_metadata` (sampling_state.py).

Order of transforms (vLLM v1's `Sampler`):

1. logprobs source: the RAW logits (see below);
2. logits to float32 (copied before any edit: the caller's tensor is never modified);
3. allowed_token_ids: every other token -> -inf;
4. min_tokens: while a row has fewer than `min_tokens` outputs, its stop_token_ids and
   (unless ignore_eos) EOS ids -> -inf;
5. logit_bias: added;
6. user logits processors `(output_ids, logits_row) -> logits_row`, row by row;
7. penalties: repetition over prompt + output tokens (a positive logit is divided by
   the penalty, a negative one multiplied: HF / vLLM), then frequency (minus penalty x
   count in the output) and presence (minus penalty if present in the output);
8. greedy rows (temperature < 1e-5): argmax of these logits (first index on ties);
9. random rows: divide by temperature;
10. min_p: drop tokens whose probability is below min_p x the top probability;
11. top_k (every token tied with the k-th largest is kept, like vLLM), then top_p over
    the renormalised top-k distribution (keep a token while the mass of the tokens
    ranked above it is < top_p; the top token always stays);
12. draw: inverse CDF with the row's one uniform number (sampling_state.py explains
    where it comes from) over the kept tokens in canonical order: probability
    descending, token id ascending on ties. The canonical order makes the drawn token
    a function of the row alone (not of the batch, nor of how ties fall in a partial
    sort).

How top-k / top-p stay cheap: the candidates are the row's `K` largest logits (K far
below the vocabulary; `topk_rows`). A row whose kept set provably lies inside its
candidates (the last kept value is strictly above the K-th candidate, or the candidates
hold every finite logit) is drawn there. Top-p without top-k needs the row's full
normaliser; the mass outside the candidates is bracketed by (V - K) x the K-th
candidate's weight, and only rows where the bracket leaves the cut open pay a
full-vocabulary pass. Rows that still do not fit retry with a larger K, then with a
full stable sort (what vLLM does for every top-p row). All stages give the same token
for the same row, so the batch never changes a row's result. Rows without top-k /
top-p draw over the full vocabulary in token-id order (one cumsum, one binary search).

Why inverse CDF rather than vLLM's exponential race (argmax of probs / Exp(1) noise):
one uniform per row instead of V noise values, so a seeded row costs one Python hash
instead of a per-row generator filling the vocabulary, and candidate pruning needs no
noise for the tokens outside the candidates. The draw is exact up to float32 rounding
of the cumulative sums (local errors of ~1e-7 per token).

A row whose every token is masked (e.g. allowed_token_ids all blocked by min_tokens)
gets an arbitrary in-range id rather than an error.

Logprobs (vLLM v1's default `raw_logprobs`): the logprob of the sampled token and the
top-k logprobs are `log_softmax` of the model's RAW logits — before steps 3-11, so no
penalty, bias, mask or temperature is reflected in them. `rank` counts the tokens
whose raw logit is >= the token's (1 = the most likely; ties count against it, as in
vLLM). Rows asking for fewer top logprobs than the batch's maximum read a prefix of
`top_token_ids` / `top_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portaserve.framework.executor.sampling_state import PenaltyTensors, RandomGroup, SamplingMetadata

# First candidate-set size for top-k / top-p rows, and how much each retry multiplies it.
NUM_CANDIDATES = 256
CANDIDATE_GROWTH = 16

# Platform features (PlatformCapabilities.features) that turn on the sampler's fast paths
# for a host CPU; a device without them gets torch's own kernels and allocator.
#: torch's argmax and topk over a long row are slower here than amax over blocks of it
#: (see `argmax_rows`, `topk_rows`).
BLOCK_REDUCTIONS = "sampler_block_reductions"
#: the device has no caching allocator, so a fresh [rows, vocab] buffer costs page faults
#: every step: the sampler keeps its scratch buffers (see `_Workspace`).
REUSE_BUFFERS = "sampler_reuse_buffers"


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One step's samples, on the CPU, in the logits' row order."""

    sampled_token_ids: torch.Tensor  # [B] int64
    # Only when some row asked for logprobs (else None):
    logprobs: torch.Tensor | None  # [B] float32, raw logprob of the sampled token
    ranks: torch.Tensor | None  # [B] int64, 1 = most likely
    top_token_ids: torch.Tensor | None  # [B, k] int64, k = the batch's max_num_logprobs
    top_logprobs: torch.Tensor | None  # [B, k] float32, descending
    #: (row, why) for rows that failed alone: a raising logits processor, no finite logit
    #: to sample (NaN, or every token masked). Their sampled id is meaningless.
    failed_rows: tuple[tuple[int, str], ...] = ()

    @property
    def rank(self) -> torch.Tensor | None:
        """Alias of `ranks`."""
        return self.ranks


class _Workspace:
    """Float32 [rows, vocab] scratch tensors, one per name and device.

    A [64, 152k] float32 tensor is ~39 MB: on the CPU every fresh allocation that size is
    a new mmap whose page faults cost more than the arithmetic, so there (`reuse`: the
    platform declares `REUSE_BUFFERS`) the sampler keeps them. Accelerators' caching
    allocators already reuse memory; there a buffer is allocated per use, so the sampler
    holds nothing between steps beside the KV cache.
    """

    def __init__(self, reuse: bool = False) -> None:
        self.reuse = reuse
        self._bufs: dict[tuple[str, torch.device], torch.Tensor] = {}

    def get(self, name: str, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        if not self.reuse:
            return torch.empty(rows, vocab, dtype=torch.float32, device=device)
        key = (name, device)
        buf = self._bufs.get(key)
        if buf is None or buf.shape[1] != vocab or buf.shape[0] < rows:
            keep = buf.shape[0] if buf is not None and buf.shape[1] == vocab else 0
            buf = torch.empty(max(rows, keep), vocab, dtype=torch.float32, device=device)
            self._bufs[key] = buf
        return buf[:rows]


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """Row maxima with -inf (a fully masked row) replaced by 0, so `x - m` stays finite-or--inf."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


_ARGMAX_BLOCK = 1024


def argmax_rows(x: torch.Tensor, *, blocked: bool = False) -> torch.Tensor:
    """`x.argmax(-1)` (first index on ties) for a [N, V] float tensor.

    On the CPU, torch's argmax is several times slower than its vectorised amax, so there
    (`blocked`: the platform declares `BLOCK_REDUCTIONS`) large rows go through block
    maxima: the first block holding the row maximum, then the first maximum inside it —
    the same index argmax returns.
    """
    n, vocab = x.shape
    if not blocked or vocab < 8 * _ARGMAX_BLOCK or x.stride(1) != 1 or n == 0:
        return x.argmax(dim=-1)
    size = _ARGMAX_BLOCK
    num_full = vocab // size
    block_max = x[:, : num_full * size].view(n, num_full, size).amax(dim=-1)  # [n, num_full]
    if num_full * size < vocab:
        block_max = torch.cat([block_max, x[:, num_full * size :].amax(dim=-1, keepdim=True)], dim=1)
    start = block_max.argmax(dim=-1) * size  # [n]
    offsets = start.view(-1, 1) + torch.arange(size, device=x.device)  # [n, size]
    vals = x.gather(1, offsets.clamp(max=vocab - 1)).masked_fill_(offsets >= vocab, float("-inf"))
    return start + vals.argmax(dim=-1)


_TOPK_BLOCK = 64


def topk_rows(x: torch.Tensor, k: int, *, blocked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(x, k)` (values descending; which of several tied k-th values are kept is
    unspecified) for a [N, V] float tensor.

    With `blocked` (the CPU: `BLOCK_REDUCTIONS`), large rows go through block maxima: the
    k largest values lie in the k blocks with the largest maxima (a block left out has k
    chosen blocks whose maxima are >= its own), so a topk over the block maxima, a gather
    of those blocks and a topk over them give every value above the k-th — at a fraction
    of torch's cost.
    """
    n, vocab = x.shape
    size = _TOPK_BLOCK
    num_full = vocab // size
    if not blocked or num_full < 4 * k or x.stride(1) != 1 or n == 0:
        return torch.topk(x, k, dim=-1)
    # full blocks compete; the ragged tail (< one block) is always a candidate
    block_max = x[:, : num_full * size].view(n, num_full, size).amax(dim=-1)  # [n, num_full]
    _, blocks = torch.topk(block_max, k, dim=-1)  # [n, k]
    offsets = ((blocks * size).unsqueeze(-1) + torch.arange(size, device=x.device)).view(n, k * size)
    if num_full * size < vocab:
        tail = torch.arange(num_full * size, vocab, device=x.device).expand(n, -1)
        offsets = torch.cat([offsets, tail], dim=1)
    top_vals, pos = torch.topk(x.gather(1, offsets), k, dim=-1)
    return top_vals, offsets.gather(1, pos)


_RANK_TOP = 8


def _count_at_least(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """#(x >= value) per row. x: [N, V] float32, value: [N, 1] -> [N] int64."""
    if not bool(torch.isfinite(value).all()):
        return (x >= value).sum(dim=-1)
    # float signs rather than a bool sum (which converts [N, V] to int64 on the CPU):
    # sum(sign) = #greater - #less and sum(|sign|) = #greater + #less, both exact.
    sign = torch.sign(x - value)
    diff = sign.sum(dim=-1)
    unequal = sign.abs_().sum(dim=-1)
    return (x.shape[1] - (unequal - diff) * 0.5).round_().long()


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int,
                   scratch: torch.Tensor | None = None, *, blocked: bool = False) -> tuple[torch.Tensor, ...]:
    """Raw logprobs of `token_ids`, their ranks, and the top-k (ids, logprobs), on the CPU.

    :param logits: [N, V] raw logits (any float dtype).
    :param token_ids: [N] int64 on the logits' device.
    :param k: number of top entries (0 gives [N, 0] tensors).
    :param scratch: optional float32 [N, V] buffer to compute in.
    :param blocked: top-k through block maxima (`topk_rows`).
    :returns: (logprob [N] float32, rank [N] int64, top ids [N, k] int64, top logprobs [N, k] float32).
    """
    x = logits.float()
    num_rows, vocab = x.shape
    buf = torch.empty_like(x) if scratch is None else scratch
    m = _finite_or_zero(x.amax(dim=-1, keepdim=True))  # [N, 1]
    lse = m + torch.sub(x, m, out=buf).exp_().sum(dim=-1, keepdim=True).log_()  # [N, 1]
    picked = x.gather(1, token_ids.view(-1, 1).long())  # [N, 1]
    # rank = #(x >= picked), comparing raw logits (x - lse is monotone: the exact order).
    # A few more top entries than asked give it directly when the token is above the
    # last of them (every token >= it is then among them); other rows count the row.
    num_top = min(max(k, _RANK_TOP) + 1, vocab)
    top_vals, top_ids = topk_rows(x, num_top, blocked=blocked)  # [N, num_top]
    rank = (top_vals >= picked).sum(dim=-1)
    outside = (picked.view(-1) <= top_vals[:, -1]) & (num_top < vocab)
    if bool(outside.any()):
        rows = outside.nonzero().view(-1)
        rank[rows] = _count_at_least(x.index_select(0, rows), picked.index_select(0, rows))
    top_lp = top_vals[:, :k] - lse
    top_ids = top_ids[:, :k].contiguous()
    return (picked - lse).view(-1).cpu(), rank.cpu(), top_ids.cpu(), top_lp.cpu()


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int, *,
                            blocked: bool = False) -> tuple[torch.Tensor, ...]:
    """Prompt logprobs of one chunk of positions: row i's logits scored against target i.

    Stateless per row, so a long prompt can be processed in chunks of any size.

    :param logits: [N, V] raw logits of N prompt positions.
    :param target_ids: [N] the actual next prompt tokens.
    :param k: how many top logprobs to return per position.
    :param blocked: top-k through block maxima (`topk_rows`; `Sampler.block_reductions`).
    :returns: (target logprob [N], rank [N], top ids [N, k], top logprobs [N, k]) on the CPU.
    """
    return token_logprobs(logits, target_ids.to(logits.device), k, blocked=blocked)


class Sampler:
    """Turns a step's logits into tokens (and logprobs), following `SamplingMetadata`."""

    def __init__(self, num_candidates: int = NUM_CANDIDATES, features: frozenset[str] = frozenset()) -> None:
        """:param features: the platform's declared features; `BLOCK_REDUCTIONS` and
        `REUSE_BUFFERS` turn on the fast paths for a host CPU."""
        self.num_candidates = num_candidates
        self.block_reductions = BLOCK_REDUCTIONS in features
        self._ws = _Workspace(reuse=REUSE_BUFFERS in features)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        :param logits: [B, V] raw logits, rows in the order of the metadata's req_ids
            (never modified).
        :param meta: from `SamplingState.make_metadata`.
        :returns: tokens [B] on the CPU, and logprobs when any row asked for them.
        """
        num_rows, vocab = logits.shape
        if num_rows != meta.num_rows:
            raise ValueError(f"logits have {num_rows} rows but the sampling metadata has {meta.num_rows}")
        device = logits.device
        raw = logits if logits.dtype == torch.float32 else self._ws.get("raw", num_rows, vocab, device).copy_(logits)
        work = raw
        failed: dict[int, str] = {}
        if meta.needs_logits_edit:
            work = self._ws.get("work", num_rows, vocab, device).copy_(raw)
            self._apply_edits(work, meta, failed)

        if meta.all_greedy:
            sampled = argmax_rows(work, blocked=self.block_reductions)
        else:
            sampled = torch.empty(num_rows, dtype=torch.int64, device=device)
            groups = [(meta.greedy_rows, None), (None if meta.plain is None else meta.plain.rows, meta.plain),
                      (None if meta.truncated is None else meta.truncated.rows, meta.truncated)]
            for rows, group in groups:
                if rows is None:
                    continue
                if rows.numel() == num_rows:
                    x = work
                else:
                    x = torch.index_select(work, 0, rows, out=self._ws.get("rows", rows.numel(), vocab, device))
                if group is None:
                    tokens = argmax_rows(x, blocked=self.block_reductions)
                else:
                    draw = self._draw_plain if group is meta.plain else self._draw_truncated
                    try:
                        tokens = draw(x, group)
                    except Exception as exc:  # a bad row (NaN) must not take the others down
                        tokens = torch.zeros(rows.numel(), dtype=torch.int64, device=device)
                        for row in rows.tolist():
                            failed.setdefault(row, f"sampling failed: {type(exc).__name__}: {exc}")
                sampled[rows] = tokens
        # A NaN row's argmax is the NaN, a fully masked row's is -inf: only such rows pick a
        # token whose logit is NaN or -inf, so one [B] gather finds them.
        chosen = work.gather(1, sampled.view(-1, 1)).view(-1)
        bad = torch.isnan(chosen) | (chosen == float("-inf"))
        if bool(bad.any()):
            for row in bad.nonzero().view(-1).tolist():
                failed.setdefault(row, "the logits hold no finite value to sample (NaN, or every token masked)")
        failures = tuple(sorted(failed.items()))

        if meta.max_num_logprobs is None:
            return SamplerOutput(sampled.cpu(), None, None, None, None, failures)
        scratch = self._ws.get("tmp", num_rows, vocab, device)
        lp, rank, top_ids, top_lp = token_logprobs(
            raw, sampled, meta.max_num_logprobs, scratch, blocked=self.block_reductions
        )
        return SamplerOutput(sampled.cpu(), lp, rank, top_ids, top_lp, failures)

    def processed_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The float32 logits after steps 2-7 (what greedy rows take the argmax of).

        For inspection and tests; `__call__` does the same work in a scratch buffer.
        """
        work = logits.float().clone()
        self._apply_edits(work, meta, {})
        return work

    # ----- steps 3-7: rewrite logits in place -------------------------------------------

    def _apply_edits(self, work: torch.Tensor, meta: SamplingMetadata, failed: dict[int, str]) -> None:
        """Allowed ids, min_tokens, logit_bias, user processors, penalties (in that order).

        A logits processor that raises fails its own row (recorded in `failed`), no other.
        """
        # work: [B, V] float32, contiguous, ours to modify
        neg_inf = float("-inf")
        if meta.allowed_rows is not None:
            rows = meta.allowed_rows.index_select(0, meta.allowed_pos)  # batch row of each allowed id
            kept = work[rows, meta.allowed_tokens]
            work.index_fill_(0, meta.allowed_rows, neg_inf)
            work[rows, meta.allowed_tokens] = kept
        if meta.min_tokens_rows is not None:
            work[meta.min_tokens_rows, meta.min_tokens_tokens] = neg_inf
        if meta.bias_rows is not None:
            work.index_put_((meta.bias_rows, meta.bias_tokens), meta.bias_values, accumulate=True)
        for row, processors, output_ids in meta.logits_processors:
            logits_row = work[row]
            try:
                for proc in processors:
                    logits_row = proc(output_ids, logits_row)
                work[row] = logits_row
            except Exception as exc:
                failed[row] = f"logits processor {type(proc).__name__} raised {type(exc).__name__}: {exc}"
        if meta.penalties is not None:
            self._apply_penalties(work, meta.penalties)

    def _apply_penalties(self, work: torch.Tensor, pen: PenaltyTensors) -> None:
        """Penalise only the tokens that occur: gather them, transform, scatter back.

        Padding entries hold token 0 and get token 0's correctly penalised value, so the
        scatter (idempotent: duplicates write equal values) needs no sentinel.
        """
        n = pen.rows.numel()
        vocab = work.shape[1]
        counts = self._ws.get("counts", n, vocab, work.device).zero_()
        counts.scatter_add_(1, pen.output_ids, pen.output_weight)  # [n, V] occurrences in the output
        ids = pen.output_ids
        in_prompt = None
        if pen.repetition is not None:
            prompt_counts = self._ws.get("prompt_counts", n, vocab, work.device).zero_()
            prompt_counts.scatter_add_(1, pen.prompt_ids, pen.prompt_weight)
            ids = torch.cat([ids, pen.prompt_ids], dim=1)
            in_prompt = prompt_counts.gather(1, ids) > 0
        # ids: [n, M] tokens to update
        flat = pen.rows.view(-1, 1) * vocab + ids  # [n, M] positions in work
        x = work.view(-1)[flat]
        c = counts.gather(1, ids)
        if pen.repetition is not None:
            seen = (c > 0) | in_prompt
            rep = pen.repetition.view(-1, 1)
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - pen.frequency.view(-1, 1) * c - pen.presence.view(-1, 1) * (c > 0).float()
        work.view(-1)[flat] = x

    # ----- steps 9-12: random draws (x holds steps 2-7's logits, never modified) --------

    def _draw_plain(self, x: torch.Tensor, group: RandomGroup) -> torch.Tensor:
        """Inverse CDF over the full vocabulary in token-id order."""
        # x: [n, V]
        n, vocab = x.shape
        m = _finite_or_zero(x.amax(dim=-1, keepdim=True))
        buf = self._ws.get("tmp", n, vocab, x.device)
        if group.temperature is None:
            e = torch.sub(x, m, out=buf)
        else:  # (x - m) / T in one pass
            inv_t = group.temperature.reciprocal().view(-1, 1)
            e = torch.addcmul(-m * inv_t, x, inv_t, out=buf)
        e.exp_()  # [n, V] probability / top probability
        if group.min_p is not None:
            e.masked_fill_(e < group.min_p.view(-1, 1), 0.0)
        c = e.cumsum_(dim=-1)
        target = group.uniforms.view(-1, 1) * c[:, -1:]
        idx = torch.searchsorted(c, target, right=True).view(-1)
        return idx.clamp_(max=vocab - 1)

    def _draw_truncated(self, x: torch.Tensor, group: RandomGroup) -> torch.Tensor:
        """Top-k / top-p rows: candidates first, bigger candidate sets for the rows that need it."""
        # x: [n, V]
        n, vocab = x.shape
        top_k = group.top_k
        max_top_k = group.max_top_k
        if top_k is not None and max_top_k >= vocab:  # top_k >= vocabulary keeps everything
            top_k = torch.where(top_k >= vocab, torch.zeros_like(top_k), top_k)
            max_top_k = int(top_k.max())
        size = max(self.num_candidates, max_top_k + 1)
        out = torch.empty(n, dtype=torch.int64, device=x.device)
        rows = torch.arange(n, device=x.device)
        # exact top-p normalisers, NaN until a row's tail-mass bounds leave its cut open
        full_mass = torch.full((n,), float("nan"), device=x.device) if group.top_p is not None else None
        while True:
            k = min(size, vocab)
            every = rows.numel() == n
            xs = x if every else x.index_select(0, rows)
            sub = [None if t is None else (t if every else t.index_select(0, rows))
                   for t in (top_k, group.top_p, group.min_p, group.temperature, group.uniforms, full_mass)]
            tokens, ok, unsure = _draw_candidates(xs, k, *sub, blocked=self.block_reductions)
            if full_mass is not None and bool(unsure.any()):
                redo = unsure.nonzero().view(-1)
                xr = xs.index_select(0, redo)
                rsub = [None if t is None else t.index_select(0, redo) for t in sub]
                rsub[5] = self._full_mass(xr, rsub[2], rsub[3])
                full_mass[rows[redo]] = rsub[5]
                tokens[redo], ok[redo], _ = _draw_candidates(xr, k, *rsub, blocked=self.block_reductions)
            if k == vocab or bool(ok.all()):
                out[rows] = tokens
                return out
            out[rows[ok]] = tokens[ok]
            rows = rows[~ok]
            size *= CANDIDATE_GROWTH

    def _full_mass(self, x: torch.Tensor, min_p: torch.Tensor | None,
                   temperature: torch.Tensor | None) -> torch.Tensor:
        """sum_v exp((x_v - max) / T) over the min_p survivors: the top-p normaliser. -> [n]"""
        n, vocab = x.shape
        m = _finite_or_zero(x.amax(dim=-1, keepdim=True))
        buf = self._ws.get("tmp", n, vocab, x.device)
        if temperature is None:
            e = torch.sub(x, m, out=buf)
        else:
            inv_t = temperature.reciprocal().view(-1, 1)
            e = torch.addcmul(-m * inv_t, x, inv_t, out=buf)
        e.exp_()
        if min_p is not None:
            e.masked_fill_(e < min_p.view(-1, 1), 0.0)
        return e.sum(dim=-1)


def _draw_candidates(x, k, top_k, top_p, min_p, temperature, uniforms, full_mass=None, *, blocked=False):
    """Draw each row from its k largest logits; `ok` says whether that was exact.

    x: [n, V] logits; top_k: [n] int64 | None; top_p, min_p, temperature, uniforms,
    full_mass (the exact top-p normaliser; NaN where unknown, and bounds are used): [n]
    float32 | None.
    Returns (tokens [n] int64, ok [n] bool, unsure [n] bool: the bounds left a top-p
    cut undecided, which `full_mass` would settle). `blocked`: see `topk_rows`.
    """
    n, vocab = x.shape
    if k >= vocab:
        # canonical order directly: a stable descending sort keeps ties in id order
        vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    else:
        vals, ids = topk_rows(x, k, blocked=blocked)
        # canonical tie order: id ascending, then a stable sort by value
        ids, perm = torch.sort(ids, dim=-1)
        vals = vals.gather(1, perm)
        vals, perm = torch.sort(vals, dim=-1, descending=True, stable=True)
        ids = ids.gather(1, perm)
    # vals, ids: [n, k], descending; temperature is applied to the candidates only (the
    # order does not change), so the canonical order is that of the logits.
    last = vals[:, -1]
    complete = (last == float("-inf")) | (k >= vocab)  # the candidates hold every finite logit
    scaled = vals - _finite_or_zero(vals[:, :1])
    if temperature is not None:
        scaled = scaled / temperature.view(-1, 1)
    e = scaled.exp_()  # [n, k] probability / top probability
    ok = complete
    if min_p is not None:
        below = e < min_p.view(-1, 1)
        # the last candidate is below the min_p cut, so is every token outside them
        ok = ok | below[:, -1]
        e.masked_fill_(below, 0.0)
    has_k = None
    if top_k is not None:
        has_k = top_k > 0
        kth = vals.gather(1, (top_k - 1).clamp(min=0, max=k - 1).view(-1, 1))  # [n, 1]
        e = e * ((vals >= kth) | ~has_k.view(-1, 1))  # ties with the k-th stay
        ok = ok | (has_k & (kth.view(-1) > last))
    unsure = torch.zeros_like(ok)
    if top_p is not None:
        # Top-p without top-k renormalises over the whole vocabulary. Unless the exact
        # normaliser is given, it is bracketed: the tokens outside the candidates weigh at
        # most (V - k) x the last candidate's weight; where both ends give the same cut,
        # that is the exact cut.
        mass = e.sum(dim=-1)
        inside = complete if has_k is None else (complete | has_k)
        before = e.cumsum(dim=-1) - e  # mass ranked strictly above each candidate
        known = torch.zeros_like(inside) if full_mass is None else ~torch.isnan(full_mass)
        tail = torch.where(inside | known, torch.zeros_like(mass), (vocab - k) * e[:, -1])
        # the top token always stays: a top_p that underflows float32 (5e-324, found by the
        # fuzzer) would otherwise keep nothing
        top = torch.zeros_like(before, dtype=torch.bool)
        top[:, 0] = True
        num_lo = ((before < (top_p * mass).view(-1, 1)) | top).sum(dim=-1)
        if full_mass is not None:
            mass = torch.where(known & ~inside, full_mass, mass)
        mass = mass + tail
        keep_p = (before < (top_p * mass).view(-1, 1)) | top
        num_kept = keep_p.sum(dim=-1)
        e = e * keep_p
        # exact if the cut falls inside the candidates, strictly above the last value
        # (no tie of the last kept token lies outside)
        last_kept = vals.gather(1, (num_kept - 1).clamp(min=0).view(-1, 1)).view(-1)
        cut_inside = (num_kept < k) & (last_kept > last)
        unsure = cut_inside & (num_lo != num_kept) & ~inside & ~known
        cut_inside = cut_inside & ~unsure
        if has_k is not None:
            cut_inside = cut_inside & ~has_k
            unsure = unsure & ~has_k
        ok = ok | cut_inside
    c = e.cumsum_(dim=-1)
    target = uniforms.view(-1, 1) * c[:, -1:]
    idx = torch.searchsorted(c, target, right=True).clamp_(max=k - 1)
    return ids.gather(1, idx).view(-1), ok, unsure & ~ok
