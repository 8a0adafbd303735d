"""The model runner's persistent per-request sampling rows, batched once per step.

`SamplingState` keeps, for every running request, what the sampler needs: its
`SamplingParams` digested into plain numbers, its prompt ids and the ids it has
generated so far. `make_metadata(req_ids, device)` turns the rows of one step (in the
order the logits rows come in) into a frozen `SamplingMetadata` of batched tensors.

The common cases stay cheap: an all-greedy batch with no penalties, masks or logprobs
builds no tensor at all; a random batch builds one small packed float tensor (one
host-to-device copy). Penalty, bias and mask tensors are built only when a row of the
step needs them.

Randomness. Each sampling row draws ONE uniform number per step, and the sampler turns
it into a token by inverse-CDF over the row's (canonically ordered) distribution:
- a seeded row's number is a pure function of (seed, number of output tokens so far):
  the SplitMix64 stream seeded with the request's seed, taken at that index. So the
  same request gives the same tokens whatever else is in the batch, wherever its row
  is, and after a preemption (the runner re-adds it with its earlier outputs, so the
  count and the next number are the same);
- unseeded rows share one batched draw from torch's default CPU generator (workers
  seeded alike draw alike).
`n > 1`: every child of a request is its own row; the front end gives child i the seed
`seed + i` when the parent is seeded (two rows with the same seed, params and logits
produce the same tokens).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from portaserve.framework.engine.params import LogitsProcessor, SamplingParams

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_INV_2_24 = 1.0 / (1 << 24)


def _mix64(z: int) -> int:
    """SplitMix64's finalizer: a bijective avalanche of a 64-bit integer."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, step: int) -> float:
    """The uniform number in [0, 1) that a request seeded with `seed` uses for output `step`.

    24 random bits, so the value is exact in float32 and strictly below 1.
    """
    state = (_mix64(seed & _M64) + (step + 1) * _GOLDEN) & _M64
    return (_mix64(state) >> 40) * _INV_2_24


class _TokenBuffer:
    """A growing int64 numpy array (amortised O(1) append, O(1) view of the prefix)."""

    __slots__ = ("data", "size")

    def __init__(self, tokens: Iterable[int]) -> None:
        init = np.fromiter(tokens, dtype=np.int64)
        self.data = np.empty(max(16, 2 * init.size), dtype=np.int64)
        self.data[: init.size] = init
        self.size = int(init.size)

    def append(self, token: int) -> None:
        if self.size == self.data.size:
            grown = np.empty(2 * self.data.size, dtype=np.int64)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        self.data[self.size] = token
        self.size += 1

    def view(self) -> np.ndarray:
        return self.data[: self.size]


class _Row:
    """One request's digested sampling parameters and token history."""

    __slots__ = (
        "greedy", "temperature", "top_k", "top_p", "min_p", "seed", "truncated",
        "presence", "frequency", "repetition", "has_penalties",
        "bias_tokens", "bias_values", "allowed", "min_tokens", "min_tokens_ids",
        "processors", "num_logprobs", "prompt", "outputs",
    )

    def __init__(self, params: SamplingParams, prompt_token_ids: Iterable[int],
                 output_token_ids: Iterable[int], eos_token_ids: frozenset[int]) -> None:
        self.greedy = params.temperature < 1e-5
        self.temperature = float(params.temperature)
        self.top_k = min(int(params.top_k), 1 << 24)  # beyond any vocabulary: keeps everything
        self.top_p = float(params.top_p)
        self.min_p = float(params.min_p)
        self.seed = params.seed
        self.truncated = self.top_k > 0 or self.top_p < 1.0
        self.presence = float(params.presence_penalty)
        self.frequency = float(params.frequency_penalty)
        self.repetition = float(params.repetition_penalty)
        self.has_penalties = self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0
        bias = params.logit_bias or {}
        self.bias_tokens = tuple(bias.keys())
        self.bias_values = tuple(bias.values())
        self.allowed = tuple(sorted(set(params.allowed_token_ids))) if params.allowed_token_ids else ()
        self.min_tokens = int(params.min_tokens)
        # ignore_eos: the EOS ids neither stop the request nor get masked by min_tokens.
        stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= set(eos_token_ids)
        self.min_tokens_ids = tuple(sorted(stop_ids))
        self.processors: tuple[LogitsProcessor, ...] = tuple(params.logits_processors or ())
        self.num_logprobs = params.logprobs
        # The prompt is only read by the repetition penalty.
        self.prompt = np.fromiter(prompt_token_ids, dtype=np.int64) if self.repetition != 1.0 else None
        self.outputs = _TokenBuffer(output_token_ids)


@dataclass(frozen=True, slots=True)
class RandomGroup:
    """The rows of one random-sampling path, with their parameters (all on the device).

    `rows` index the batch; the other tensors are aligned with `rows`.
    """

    rows: torch.Tensor  # [n] int64
    temperature: torch.Tensor | None  # [n] float32; None when every row has temperature 1
    min_p: torch.Tensor | None  # [n] float32; None when no row uses min_p
    uniforms: torch.Tensor  # [n] float32 in [0, 1): the row's random draw this step
    top_k: torch.Tensor | None = None  # [n] int64, 0 = off (truncated group only)
    top_p: torch.Tensor | None = None  # [n] float32, 1 = off (truncated group only)
    max_top_k: int = 0  # largest top_k of the group (sizes the candidate set)


@dataclass(frozen=True, slots=True)
class PenaltyTensors:
    """Presence / frequency / repetition penalties of the rows that use any."""

    rows: torch.Tensor  # [n] int64 batch rows
    presence: torch.Tensor  # [n] float32
    frequency: torch.Tensor  # [n] float32
    repetition: torch.Tensor | None  # [n] float32; None when every row has 1.0
    output_ids: torch.Tensor  # [n, max_outputs] int64 (padding holds id 0 ...)
    output_weight: torch.Tensor  # [n, max_outputs] float32 (... with weight 0)
    prompt_ids: torch.Tensor | None  # [n, max_prompt] int64, only with repetition
    prompt_weight: torch.Tensor | None  # [n, max_prompt] float32


@dataclass(frozen=True, slots=True)
class SamplingMetadata:
    """One step's sampling parameters as batched tensors, in the logits' row order."""

    num_rows: int
    all_greedy: bool
    all_random: bool
    greedy_rows: torch.Tensor | None  # [g] int64; None when all rows are greedy or none is
    plain: RandomGroup | None  # random rows without top-k / top-p
    truncated: RandomGroup | None  # random rows with top-k and/or top-p
    no_penalties: bool
    penalties: PenaltyTensors | None
    # logit_bias as (row, token, value) triples, added with accumulation
    bias_rows: torch.Tensor | None  # [m] int64
    bias_tokens: torch.Tensor | None  # [m] int64
    bias_values: torch.Tensor | None  # [m] float32
    # allowed_token_ids: rows that restrict, and (position in allowed_rows, token) pairs
    allowed_rows: torch.Tensor | None  # [a] int64
    allowed_pos: torch.Tensor | None  # [m] int64
    allowed_tokens: torch.Tensor | None  # [m] int64
    # min_tokens: (row, token) pairs set to -inf (stop ids and EOS while too short)
    min_tokens_rows: torch.Tensor | None  # [m] int64
    min_tokens_tokens: torch.Tensor | None  # [m] int64
    # user logits processors: (row, processors, output ids so far)
    logits_processors: tuple[tuple[int, tuple[LogitsProcessor, ...], list[int]], ...]
    max_num_logprobs: int | None  # None: no row asked for logprobs

    @property
    def needs_logits_edit(self) -> bool:
        """Whether any transform before sampling rewrites logits (so the sampler copies them)."""
        return (
            self.penalties is not None
            or self.bias_rows is not None
            or self.allowed_rows is not None
            or self.min_tokens_rows is not None
            or bool(self.logits_processors)
        )


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device)


def _padded(arrays: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad int64 arrays into [n, max_len] ids (pad id 0) and float weights (pad 0)."""
    width = max(1, max(a.size for a in arrays))
    ids = np.zeros((len(arrays), width), dtype=np.int64)
    weight = np.zeros((len(arrays), width), dtype=np.float32)
    for i, a in enumerate(arrays):
        ids[i, : a.size] = a
        weight[i, : a.size] = 1.0
    return torch.from_numpy(ids).to(device), torch.from_numpy(weight).to(device)


class SamplingState:
    """Per-request sampling rows that persist across steps (vLLM v1 InputBatch's sampling part)."""

    def __init__(self) -> None:
        self._rows: dict[str, _Row] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def add_request(self, req_id: str, params: SamplingParams, prompt_token_ids: Iterable[int],
                    output_token_ids: Iterable[int], eos_token_ids: frozenset[int]) -> None:
        """Start tracking a request (or rebuild it after a preemption, outputs included).

        :param eos_token_ids: the model's EOS ids (may also hold the stop ids); masked by
            `min_tokens` unless `ignore_eos`.
        """
        self._rows[req_id] = _Row(params, prompt_token_ids, output_token_ids, eos_token_ids)

    def append_output(self, req_id: str, token_id: int) -> None:
        """Record the token sampled for a request this step."""
        self._rows[req_id].outputs.append(token_id)

    def history_free_greedy(self, req_id: str) -> bool:
        """Whether the request's next tokens are each the argmax of logits its own outputs
        do not edit (greedy; no penalties, logits processors or min_tokens left)."""
        row = self._rows[req_id]
        return row.greedy and not row.has_penalties and not row.processors and row.outputs.size >= row.min_tokens

    def remove_request(self, req_id: str) -> None:
        """Forget a finished, aborted or preempted request (no-op if unknown)."""
        self._rows.pop(req_id, None)

    def num_logprobs(self, req_id: str) -> int | None:
        """How many top logprobs the request wants per sampled token (None: no logprobs)."""
        return self._rows[req_id].num_logprobs

    def num_output_tokens(self, req_id: str) -> int:
        """How many tokens the request has generated (what seeds its next draw)."""
        return self._rows[req_id].outputs.size

    def make_metadata(self, req_ids: list[str], device: torch.device | str) -> SamplingMetadata:
        """Batch the rows of `req_ids` (in this order) for one sampler call."""
        device = torch.device(device)
        rows = [self._rows[r] for r in req_ids]
        greedy_idx: list[int] = []
        plain_idx: list[int] = []
        trunc_idx: list[int] = []
        special = False
        max_logprobs: int | None = None
        for i, row in enumerate(rows):
            if row.greedy:
                greedy_idx.append(i)
            elif row.truncated:
                trunc_idx.append(i)
            else:
                plain_idx.append(i)
            if row.num_logprobs is not None and (max_logprobs is None or row.num_logprobs > max_logprobs):
                max_logprobs = row.num_logprobs
            if (row.has_penalties or row.bias_tokens or row.allowed or row.processors
                    or row.outputs.size < row.min_tokens):
                special = True
        num_rows = len(rows)
        all_greedy = len(greedy_idx) == num_rows
        all_random = not greedy_idx
        plain, truncated = self._random_groups(rows, plain_idx, trunc_idx, device)
        fields = dict(
            penalties=None, bias_rows=None, bias_tokens=None, bias_values=None,
            allowed_rows=None, allowed_pos=None, allowed_tokens=None,
            min_tokens_rows=None, min_tokens_tokens=None, logits_processors=(),
        )
        if special:
            fields.update(self._special(rows, device))
        return SamplingMetadata(
            num_rows=num_rows,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_rows=None if all_greedy or all_random else _long(greedy_idx, device),
            plain=plain,
            truncated=truncated,
            no_penalties=fields["penalties"] is None,
            max_num_logprobs=max_logprobs,
            **fields,
        )

    # ----- helpers ---------------------------------------------------------------------

    def _random_groups(self, rows: list[_Row], plain_idx: list[int], trunc_idx: list[int],
                       device: torch.device) -> tuple[RandomGroup | None, RandomGroup | None]:
        """Both random groups' parameters, packed into one float tensor (one device copy)."""
        num_random = len(plain_idx) + len(trunc_idx)
        if num_random == 0:
            return None, None
        order = plain_idx + trunc_idx
        sel = [rows[i] for i in order]
        num_unseeded = sum(1 for r in sel if r.seed is None)
        draws = iter(torch.rand(num_unseeded).tolist() if num_unseeded else ())
        uniforms = [next(draws) if r.seed is None else seeded_uniform(r.seed, r.outputs.size) for r in sel]
        temps = [r.temperature for r in sel]
        min_ps = [r.min_p for r in sel]
        top_ks = [r.top_k for r in sel]
        top_ps = [r.top_p for r in sel]
        # packed: [6, num_random] = row index, temperature, min_p, uniform, top_k, top_p
        # (row indices and top_k are <= 2**24, so float32 holds them exactly)
        flat = order + temps + min_ps + uniforms + top_ks + top_ps
        packed = np.fromiter(flat, dtype=np.float32, count=len(flat)).reshape(6, num_random)
        any_temp = any(t != 1.0 for t in temps)
        any_min_p = any(m > 0.0 for m in min_ps)
        max_top_k = max(top_ks[len(plain_idx):], default=0)
        any_top_k = max_top_k > 0
        any_top_p = any(t < 1.0 for t in top_ps)
        dev = torch.from_numpy(packed).to(device)
        row_ids = dev[0].long()
        p = len(plain_idx)

        def group(lo: int, hi: int, truncated: bool) -> RandomGroup | None:
            if lo == hi:
                return None
            return RandomGroup(
                rows=row_ids[lo:hi],
                temperature=dev[1, lo:hi] if any_temp else None,
                min_p=dev[2, lo:hi] if any_min_p else None,
                uniforms=dev[3, lo:hi],
                top_k=dev[4, lo:hi].long() if truncated and any_top_k else None,
                top_p=dev[5, lo:hi] if truncated and any_top_p else None,
                max_top_k=max_top_k if truncated else 0,
            )

        return group(0, p, False), group(p, num_random, True)

    def _special(self, rows: list[_Row], device: torch.device) -> dict:
        """The tensors of the rarer transforms, for the rows that use them."""
        out: dict = {}
        pen_rows = [i for i, r in enumerate(rows) if r.has_penalties]
        if pen_rows:
            pen = [rows[i] for i in pen_rows]
            out_ids, out_w = _padded([r.outputs.view() for r in pen], device)
            use_rep = any(r.repetition != 1.0 for r in pen)
            prompt_ids = prompt_w = None
            if use_rep:
                empty = np.zeros(0, dtype=np.int64)
                prompt_ids, prompt_w = _padded([r.prompt if r.prompt is not None else empty for r in pen], device)
            floats = torch.tensor([[r.presence for r in pen], [r.frequency for r in pen],
                                   [r.repetition for r in pen]], dtype=torch.float32).to(device)
            out["penalties"] = PenaltyTensors(
                rows=_long(pen_rows, device), presence=floats[0], frequency=floats[1],
                repetition=floats[2] if use_rep else None,
                output_ids=out_ids, output_weight=out_w, prompt_ids=prompt_ids, prompt_weight=prompt_w,
            )
        b_rows: list[int] = []
        b_toks: list[int] = []
        b_vals: list[float] = []
        a_rows: list[int] = []
        a_pos: list[int] = []
        a_toks: list[int] = []
        m_rows: list[int] = []
        m_toks: list[int] = []
        procs = []
        for i, r in enumerate(rows):
            if r.bias_tokens:
                b_rows.extend([i] * len(r.bias_tokens))
                b_toks.extend(r.bias_tokens)
                b_vals.extend(r.bias_values)
            if r.allowed:
                a_pos.extend([len(a_rows)] * len(r.allowed))
                a_rows.append(i)
                a_toks.extend(r.allowed)
            if r.outputs.size < r.min_tokens and r.min_tokens_ids:
                m_rows.extend([i] * len(r.min_tokens_ids))
                m_toks.extend(r.min_tokens_ids)
            if r.processors:
                procs.append((i, r.processors, r.outputs.view().tolist()))
        if b_rows:
            out.update(bias_rows=_long(b_rows, device), bias_tokens=_long(b_toks, device),
                       bias_values=torch.tensor(b_vals, dtype=torch.float32).to(device))
        if a_rows:
            out.update(allowed_rows=_long(a_rows, device), allowed_pos=_long(a_pos, device),
                       allowed_tokens=_long(a_toks, device))
        if m_rows:
            out.update(min_tokens_rows=_long(m_rows, device), min_tokens_tokens=_long(m_toks, device))
        out["logits_processors"] = tuple(procs)
        return out
