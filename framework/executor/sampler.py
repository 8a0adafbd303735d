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

How top-k / top-p stay cheap: the candidates are the row's `K` largest logits
(`torch.topk`, K far below the vocabulary); a row whose kept set provably lies inside
its candidates (the last kept value is strictly above the K-th candidate, or the
candidates hold every finite logit) is drawn there; the others retry with a larger K,
then with a full stable sort. All stages give the same token for the same row, so the
batch never changes a row's result. Rows without top-k / top-p draw over the full
vocabulary in token-id order (one cumsum, one binary search).

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


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """One step's samples, on the CPU, in the logits' row order."""

    sampled_token_ids: torch.Tensor  # [B] int64
    # Only when some row asked for logprobs (else None):
    logprobs: torch.Tensor | None  # [B] float32, raw logprob of the sampled token
    ranks: torch.Tensor | None  # [B] int64, 1 = most likely
    top_token_ids: torch.Tensor | None  # [B, k] int64, k = the batch's max_num_logprobs
    top_logprobs: torch.Tensor | None  # [B, k] float32, descending

    @property
    def rank(self) -> torch.Tensor | None:
        """Alias of `ranks`."""
        return self.ranks


def _log_normalizer(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim of a float32 [N, V] tensor, keepdim."""
    # x: [N, V] -> [N, 1]
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return m + (x - m).exp_().sum(dim=-1, keepdim=True).log_()


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Raw logprobs of `token_ids`, their ranks, and the top-k (ids, logprobs), on the CPU.

    :param logits: [N, V] raw logits (any float dtype).
    :param token_ids: [N] int64 on the logits' device.
    :param k: number of top entries (0 gives [N, 0] tensors).
    :returns: (logprob [N] float32, rank [N] int64, top ids [N, k] int64, top logprobs [N, k] float32).
    """
    x = logits.float()
    lse = _log_normalizer(x)  # [N, 1]
    picked = x.gather(1, token_ids.view(-1, 1).long())  # [N, 1]
    # Ranks compare raw logits: x - lse is monotone, so this is the exact order.
    rank = (x >= picked).sum(dim=-1)
    if k > 0:
        top_vals, top_ids = torch.topk(x, min(k, x.shape[-1]), dim=-1)
        top_lp = top_vals - lse
    else:
        top_ids = torch.zeros(x.shape[0], 0, dtype=torch.int64, device=x.device)
        top_lp = torch.zeros(x.shape[0], 0, dtype=torch.float32, device=x.device)
    return (
        (picked - lse).view(-1).cpu(),
        rank.cpu(),
        top_ids.cpu(),
        top_lp.cpu(),
    )


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Prompt logprobs of one chunk of positions: row i's logits scored against target i.

    Stateless per row, so a long prompt can be processed in chunks of any size.

    :param logits: [N, V] raw logits of N prompt positions.
    :param target_ids: [N] the actual next prompt tokens.
    :param k: how many top logprobs to return per position.
    :returns: (target logprob [N], rank [N], top ids [N, k], top logprobs [N, k]) on the CPU.
    """
    return token_logprobs(logits, target_ids.to(logits.device), k)


class Sampler:
    """Turns a step's logits into tokens (and logprobs), following `SamplingMetadata`."""

    def __init__(self, num_candidates: int = NUM_CANDIDATES) -> None:
        self.num_candidates = num_candidates

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        :param logits: [B, V] raw logits, rows in the order of the metadata's req_ids.
        :param meta: from `SamplingState.make_metadata`.
        :returns: tokens [B] on the CPU, and logprobs when any row asked for them.
        """
        num_rows, vocab = logits.shape
        if num_rows != meta.num_rows:
            raise ValueError(f"logits have {num_rows} rows but the sampling metadata has {meta.num_rows}")
        work = logits.float()
        if meta.needs_logits_edit:
            if work is logits:
                work = logits.clone()
            work = self._apply_edits(work, meta)

        if meta.all_greedy:
            sampled = work.argmax(dim=-1)
        else:
            sampled = torch.empty(num_rows, dtype=torch.int64, device=work.device)
            if meta.greedy_rows is not None:
                sampled[meta.greedy_rows] = work.index_select(0, meta.greedy_rows).argmax(dim=-1)
            for group, draw, consumes in ((meta.plain, self._draw_plain, True),
                                          (meta.truncated, self._draw_truncated, False)):
                if group is None:
                    continue
                if group.rows.numel() == num_rows:
                    x, owned = work, work is not logits
                else:
                    x, owned = work.index_select(0, group.rows), True
                if group.temperature is not None:
                    t = group.temperature.view(-1, 1)
                    x, owned = (x.div_(t) if owned else x / t), True
                if consumes and not owned:
                    x = x.clone()
                sampled[group.rows] = draw(x, group)

        if meta.max_num_logprobs is None:
            return SamplerOutput(sampled.cpu(), None, None, None, None)
        lp, rank, top_ids, top_lp = token_logprobs(logits, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled.cpu(), lp, rank, top_ids, top_lp)

    def processed_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The float32 logits after steps 2-7 (what greedy rows take the argmax of).

        For inspection and tests; `__call__` does the same work without this copy.
        """
        return self._apply_edits(logits.float().clone(), meta)

    # ----- steps 3-7: rewrite logits ----------------------------------------------------

    def _apply_edits(self, work: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Allowed ids, min_tokens, logit_bias, user processors, penalties (in that order)."""
        neg_inf = float("-inf")
        if meta.allowed_rows is not None:
            keep = torch.zeros(meta.allowed_rows.numel(), work.shape[1], dtype=torch.bool, device=work.device)
            keep[meta.allowed_pos, meta.allowed_tokens] = True
            sub = work.index_select(0, meta.allowed_rows).masked_fill_(~keep, neg_inf)
            work.index_copy_(0, meta.allowed_rows, sub)
        if meta.min_tokens_rows is not None:
            work[meta.min_tokens_rows, meta.min_tokens_tokens] = neg_inf
        if meta.bias_rows is not None:
            work.index_put_((meta.bias_rows, meta.bias_tokens), meta.bias_values, accumulate=True)
        for row, processors, output_ids in meta.logits_processors:
            logits_row = work[row]
            for proc in processors:
                logits_row = proc(output_ids, logits_row)
            work[row] = logits_row
        if meta.penalties is not None:
            self._apply_penalties(work, meta.penalties)
        return work

    @staticmethod
    def _apply_penalties(work: torch.Tensor, pen: PenaltyTensors) -> None:
        vocab = work.shape[1]
        n = pen.rows.numel()
        x = work.index_select(0, pen.rows)  # [n, V]
        counts = torch.zeros(n, vocab, dtype=torch.float32, device=work.device)
        counts.scatter_add_(1, pen.output_ids, pen.output_weight)  # occurrences in the output
        if pen.repetition is not None:
            seen = counts > 0
            prompt_counts = torch.zeros_like(counts).scatter_add_(1, pen.prompt_ids, pen.prompt_weight)
            seen |= prompt_counts > 0
            rep = pen.repetition.view(-1, 1).expand(n, vocab)
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x -= pen.frequency.view(-1, 1) * counts
        x -= pen.presence.view(-1, 1) * (counts > 0).float()
        work.index_copy_(0, pen.rows, x)

    # ----- steps 9-12: random draws ------------------------------------------------------

    @staticmethod
    def _draw_plain(x: torch.Tensor, group: RandomGroup) -> torch.Tensor:
        """Inverse CDF over the full vocabulary in token-id order (x is consumed)."""
        # x: [n, V] temperature-scaled logits
        m = x.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a fully masked row stays finite
        e = x.sub_(m).exp_()  # probabilities / top probability
        if group.min_p is not None:
            e.masked_fill_(e < group.min_p.view(-1, 1), 0.0)
        c = e.cumsum_(dim=-1)
        target = group.uniforms.view(-1, 1) * c[:, -1:]
        idx = torch.searchsorted(c, target, right=True).view(-1)
        return idx.clamp_(max=x.shape[1] - 1)

    def _draw_truncated(self, x: torch.Tensor, group: RandomGroup) -> torch.Tensor:
        """Top-k / top-p rows: candidates first, bigger candidate sets for the rows that need it."""
        # x: [n, V] temperature-scaled logits
        n, vocab = x.shape
        top_k = group.top_k
        max_top_k = group.max_top_k
        if top_k is not None and max_top_k >= vocab:
            top_k = torch.where(top_k >= vocab, torch.zeros_like(top_k), top_k)
            max_top_k = int(top_k.max())
        size = max(self.num_candidates, max_top_k + 1)
        out = torch.empty(n, dtype=torch.int64, device=x.device)
        rows = torch.arange(n, device=x.device)
        full_mass: torch.Tensor | None = None
        if group.top_p is not None:
            # top-p without top-k renormalises over the whole (min_p-filtered) vocabulary
            m = x.amax(dim=-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            e = (x - m).exp_()
            if group.min_p is not None:
                e.masked_fill_(e < group.min_p.view(-1, 1), 0.0)
            full_mass = e.sum(dim=-1)
            del e
        while True:
            k = min(size, vocab)
            sub = lambda t: None if t is None else t.index_select(0, rows)  # noqa: E731
            xs = x.index_select(0, rows) if rows.numel() != n else x
            tokens, ok = self._draw_candidates(
                xs, k, sub(top_k), sub(group.top_p), sub(group.min_p), group.uniforms.index_select(0, rows),
                sub(full_mass),
            )
            if k == vocab:
                out[rows] = tokens
                return out
            done = ok.nonzero().view(-1)
            out[rows[done]] = tokens[done]
            rows = rows[~ok]
            if rows.numel() == 0:
                return out
            size *= CANDIDATE_GROWTH

    @staticmethod
    def _draw_candidates(x, k, top_k, top_p, min_p, uniforms, full_mass):
        """Draw each row from its k largest logits; `ok` says whether that was exact.

        x: [n, V]; top_k: [n] int64 | None; top_p, min_p, uniforms, full_mass: [n] | None.
        Returns (tokens [n] int64, ok [n] bool).
        """
        n, vocab = x.shape
        if k >= vocab:
            # canonical order directly: a stable descending sort keeps ties in id order
            vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
        else:
            vals, ids = torch.topk(x, k, dim=-1)
            # canonical tie order: id ascending, then a stable sort by value
            ids, perm = torch.sort(ids, dim=-1)
            vals = vals.gather(1, perm)
            vals, perm = torch.sort(vals, dim=-1, descending=True, stable=True)
            ids = ids.gather(1, perm)
        # vals, ids: [n, k], descending
        last = vals[:, -1]
        complete = torch.full((n,), k >= vocab, dtype=torch.bool, device=x.device) | (last == float("-inf"))
        top = vals[:, :1]
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        e = (vals - top).exp_()  # [n, k] probabilities / top probability
        ok = complete.clone()
        if min_p is not None:
            below = e < min_p.view(-1, 1)
            # the last candidate below the min_p cut: so is every token outside the candidates
            ok |= below[:, -1]
            e.masked_fill_(below, 0.0)
        has_k = None
        if top_k is not None:
            has_k = top_k > 0
            kth = vals.gather(1, (top_k - 1).clamp_(min=0, max=k - 1).view(-1, 1))  # [n, 1]
            keep = (vals >= kth) | ~has_k.view(-1, 1)
            e = e * keep
            ok |= has_k & (kth.view(-1) > last)
        if top_p is not None:
            if full_mass is not None:
                mass = e.sum(dim=-1)
                # rows with top-k, or complete, renormalise over their candidates
                if has_k is not None:
                    mass = torch.where(has_k | complete, mass, full_mass)
                else:
                    mass = torch.where(complete, mass, full_mass)
            else:
                mass = e.sum(dim=-1)
            c = e.cumsum(dim=-1)
            before = c - e  # mass ranked strictly above each candidate
            keep_p = before < (top_p * mass).view(-1, 1)
            e = e * keep_p
            # the cut is exact if it falls inside the candidates, strictly above the last value
            num_kept = keep_p.sum(dim=-1)
            last_kept = vals.gather(1, (num_kept - 1).clamp_(min=0).view(-1, 1)).view(-1)
            cut_inside = (num_kept < k) & (last_kept > last)
            if has_k is not None:
                ok |= ~has_k & cut_inside
            else:
                ok |= cut_inside
        c = e.cumsum_(dim=-1)
        target = uniforms.view(-1, 1) * c[:, -1:]
        idx = torch.searchsorted(c, target, right=True).clamp_(max=k - 1)
        return ids.gather(1, idx).view(-1), ok
