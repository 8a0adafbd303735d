"""A step's model inputs, built from the runner's record of each request.

The runner keeps one `RequestState` per running request (its tokens and block table);
`build_inputs` turns the requests scheduled this step into the flat host arrays the
model and the attention backends read: token ids, positions, KV-cache slots, and one
`AttentionBatch`. Everything is vectorized over the step's tokens: the only per-request
Python work is gathering each request's new token ids and its block-table row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from portaserve.framework.interfaces import AttentionBatch
from portaserve.framework.layer_context import StepContext


@dataclass(slots=True)
class RequestState:
    """The runner's record of one running request."""

    req_id: str
    token_ids: list[int]  # prompt, then every token sampled so far
    num_prompt_tokens: int
    block_ids: list[int]  # its block table
    num_computed_tokens: int  # tokens already in the KV cache
    prompt_logprobs: int | None = None
    is_pooling: bool = False
    mm_features: tuple = ()  # MultiModalFeatures (placements and hashes) of its prompt
    # multimodal RoPE (Qwen2-VL): the prompt's [3, num_prompt_tokens] positions and the
    # shift of every later token's position; None for ordinary positions
    rope_positions: tuple | None = None
    lora_id: int = 0  # its adapter's lora_int_id, 0 for the base model


@dataclass(frozen=True, slots=True)
class HostInputs:
    """One step's inputs on the host, in batch order, before any padding."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    batch: AttentionBatch
    # query_start_loc: [num_seqs + 1] int64, where each request's rows start in the hidden states
    query_start_loc: np.ndarray


@dataclass(frozen=True, slots=True)
class ModelInputs:
    """Everything one forward needs, on the model's device (what `_run_model` takes)."""

    req_ids: tuple[str, ...]
    states: tuple[RequestState, ...]  # the records of `req_ids`, same order
    input_ids: torch.Tensor  # [num_padded_tokens] int64
    positions: torch.Tensor  # [num_padded_tokens] int64
    step: StepContext  # attention metadata, KV caches, sequence bounds
    # query_start_loc: [num_seqs + 1] int64 on the host: request i's rows are [qsl[i], qsl[i+1])
    query_start_loc: np.ndarray
    num_tokens: int  # real tokens; rows past it are padding

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)


def slot_mapping(block_table: np.ndarray, row_of_token: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The flat KV-cache slot of each new token: its block (from its request's row of the
    block table) times the block size, plus its offset in the block.

    block_table: [num_seqs, max_blocks]; row_of_token, positions: [num_tokens] -> [num_tokens] int64
    """
    blocks = block_table[row_of_token, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size


def build_inputs(
    states: Sequence[RequestState], num_new_tokens: Sequence[int], block_size: int, *, with_kv_cache: bool
) -> HostInputs:
    """The host inputs for computing `num_new_tokens[i]` tokens of `states[i]`, from its
    `num_computed_tokens` on. Without a KV cache (encoders) every slot is 0."""
    num_seqs = len(states)
    query_lens = np.fromiter(num_new_tokens, dtype=np.int64, count=num_seqs)
    starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_seqs)
    seq_lens = starts + query_lens
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    # token t of request i sits at position starts[i] + (t - query_start_loc[i])
    row_of_token = np.repeat(np.arange(num_seqs), query_lens)
    positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - query_start_loc[:-1], query_lens)

    max_blocks = max(1, max(len(s.block_ids) for s in states))
    block_table = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    for i, state in enumerate(states):
        block_table[i, : len(state.block_ids)] = state.block_ids
    if with_kv_cache:
        slots = slot_mapping(block_table, row_of_token, positions, block_size)
    else:
        slots = np.zeros(num_tokens, dtype=np.int64)

    token_ids: list[int] = []
    for state, start, end in zip(states, starts.tolist(), seq_lens.tolist()):
        token_ids += state.token_ids[start:end]
    batch = AttentionBatch(
        query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slots),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
        num_actual_tokens=num_tokens,
    )
    return HostInputs(
        input_ids=torch.tensor(token_ids, dtype=torch.long),
        positions=torch.from_numpy(positions),
        batch=batch,
        query_start_loc=query_start_loc,
    )
