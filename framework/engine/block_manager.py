"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, prefix caching.

Pure Python, no tensors: the block manager only decides which physical block ids a
request's tokens live in; the model runner and attention backends own the memory.

Blocks
    `num_blocks` blocks of `block_size` token slots. Block 0 is reserved as the null
    block (never handed out) unless `reserve_null_block=False`: a runner may point
    padding rows of its block table or padded tokens of a captured graph at block 0
    without corrupting any request's K/V. The usable capacity is therefore
    `num_blocks - 1` blocks; `num_usable_blocks` says which.

Free pools
    A block whose reference count drops to 0 goes back to one of two pools:
    - blocks that hold no cached prefix ("uncached"), handed out first;
    - blocks that still hold a full, hashed prefix ("cached-free"), kept in LRU order
      and evicted (their hash dropped) only when the uncached pool is empty.
    Both count as free. A request's blocks are released tail first, so among one
    request's blocks the later ones (least likely to be shared) are evicted first.

Prefix caching
    Each FULL block of a request's token sequence (prompt, then outputs) gets a
    chained hash: H(parent block's hash, the block's token ids, extra keys), where the
    extra keys (the request's `cache_salt`) enter the first block only — the chain
    carries them to every later block. Equal hashes mean equal whole prefixes, so a
    later request with the same prefix reuses the blocks (reference count + 1) instead
    of recomputing them. A hit never covers the last token of the sequence: the model
    must compute at least that position to produce logits.

    Hashes are registered when a block is ALLOCATED with enough scheduled tokens to be
    full, not after the step ran, so a sibling scheduled later in the same step (n > 1
    fan-out) already hits the prompt's blocks. This is safe because attention backends
    write every new K/V of a batch before any read. If the scheduler drops a request
    from the step it was scheduled in, it frees the request with `num_computed_tokens`
    so the never-written blocks lose their hash.

Hash function
    `hash_algo="sha256"` (default, like vLLM): collision-resistant, so no prompt can be
    crafted to alias another tenant's cached prefix. `hash_algo="builtin"`: Python's
    64-bit `hash()` of a tuple; 3-10x cheaper per block (sha256 ~1.5-4 us vs ~0.4 us for
    16 tokens, benchmarks/scheduler_overhead.py), fine against accidental collisions
    (birthday bound ~2**32 distinct blocks) but NOT against adversarial ones — int
    tuples hash predictably — so only for trusted single-tenant use. The saving is
    small in practice: a decode step hashes batch/block_size blocks, a 2048-token
    prefill 128. Either way hashes are only compared within one process.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from portaserve.framework.errors import invalid

from .request import Request

NULL_BLOCK_ID = 0
HASH_ALGOS = ("sha256", "builtin")

# Parent "hash" of every request's first block; versioned so a format change never
# aliases old hashes (should they ever be persisted).
_SHA256_ROOT = hashlib.sha256(b"portaserve-prefix-cache-v1").digest()
_BUILTIN_ROOT = 0x5EED


def _sha256_block_hash(parent: bytes, token_ids: Sequence[int], extra: Any) -> bytes:
    h = hashlib.sha256(parent)
    # 'q' = int64: token ids are non-negative ints far below 2**63
    h.update(array("q", token_ids).tobytes())
    if extra is not None:
        h.update(b"\x00salt\x00" + str(extra).encode("utf-8"))
    return h.digest()


def _builtin_block_hash(parent: int, token_ids: Sequence[int], extra: Any) -> int:
    return hash((parent, tuple(token_ids), extra))


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache lookups, in tokens."""

    num_queries: int  # tokens looked up (a request's whole sequence when it is admitted)
    num_hits: int  # of those, tokens served from cached blocks


class _RequestBlocks:
    """What the block manager keeps per request."""

    __slots__ = ("block_ids", "hashes", "num_registered")

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        # Chained hashes of the request's full blocks, computed lazily, in order.
        self.hashes: list[Hashable] = []
        # Blocks [0, num_registered) are hashed or were checked against the cache.
        self.num_registered = 0


class BlockManager:
    """Allocates KV blocks to requests, with reference counts and prefix caching."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        *,
        hash_algo: str = "sha256",
        reserve_null_block: bool = True,
    ) -> None:
        first = 1 if reserve_null_block else 0
        if not isinstance(num_blocks, int) or num_blocks < first + 1:
            raise invalid("num_blocks", f"must be an integer >= {first + 1} (block 0 is the reserved null block), got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise invalid("block_size", f"must be an integer >= 1, got {block_size!r}")
        if hash_algo not in HASH_ALGOS:
            raise invalid("hash_algo", f"must be one of {HASH_ALGOS}, got {hash_algo!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.null_block_id: int | None = NULL_BLOCK_ID if reserve_null_block else None
        self.num_usable_blocks = num_blocks - first
        self._hash_fn = _sha256_block_hash if hash_algo == "sha256" else _builtin_block_hash
        self._root: Hashable = _SHA256_ROOT if hash_algo == "sha256" else _BUILTIN_ROOT

        self._ref_cnt = [0] * num_blocks
        self._block_hash: list[Hashable | None] = [None] * num_blocks
        self._free_uncached: deque[int] = deque(range(first, num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._cached: dict[Hashable, int] = {}  # block hash -> block id
        self._requests: dict[str, _RequestBlocks] = {}
        self._num_queries = 0
        self._num_hits = 0

    # ----- queries -----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (uncached free + cached free)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._num_queries, self._num_hits)

    def block_ids(self, request: Request) -> tuple[int, ...]:
        """The request's block table, in token order (empty if it holds none)."""
        state = self._requests.get(request.request_id)
        return tuple(state.block_ids) if state is not None else ()

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether the block holds a registered prefix hash."""
        return self._block_hash[block_id] is not None

    def capacity_tokens(self) -> int:
        """Tokens one request can hold if it has the whole cache to itself."""
        return self.num_usable_blocks * self.block_size

    # ----- hashing -----------------------------------------------------------------

    def _extra_key(self, request: Request) -> Any:
        # an adapter changes every layer's keys and values: blocks are shared per adapter only
        lora = request.lora_request
        return request.cache_salt if lora is None else (request.cache_salt, "lora", lora.lora_int_id)

    def _hash_block(self, request: Request, state: _RequestBlocks) -> Hashable:
        """Compute and append the hash of the request's next unhashed full block."""
        i = len(state.hashes)
        bs = self.block_size
        start, end = i * bs, (i + 1) * bs
        prompt = request.prompt_token_ids
        num_prompt = len(prompt)
        if end <= num_prompt:
            tokens = prompt[start:end]
        elif start >= num_prompt:
            tokens = request.output_token_ids[start - num_prompt : end - num_prompt]
        else:
            tokens = prompt[start:] + request.output_token_ids[: end - num_prompt]
        parent = state.hashes[-1] if i else self._root
        extra = self._extra_key(request) if i == 0 else None
        if request.mm_features:
            # identical placeholder tokens stand for different images: the images' hashes
            # make the block's hash differ
            images = tuple(f.hash for f in request.mm_features if f.overlaps(start, end))
            if images:
                extra = (extra, images)
        h = self._hash_fn(parent, tokens, extra)
        state.hashes.append(h)
        return h

    def _state(self, request: Request) -> _RequestBlocks:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestBlocks()
        return state

    # ----- lookups and allocation ----------------------------------------------------

    def get_computed_blocks(self, request: Request, *, record_stats: bool = True) -> tuple[list[int], int]:
        """Longest cached prefix of a request that holds no blocks yet.

        :returns: (block ids to pass to `allocate_slots`, number of tokens they hold).
            The hit is whole blocks and never reaches the sequence's last token.
            Requests that want prompt logprobs never read the cache (every prompt
            position must be computed to score it), but still fill it.
        :param record_stats: count the lookup in `stats`; the scheduler passes False
            and calls `record_query` once the request is actually admitted, so a
            request that waits several steps is counted once.
        """
        if not self.enable_caching or _skips_cache_read(request):
            if record_stats:
                self.record_query(request.num_tokens, 0)
            return [], 0
        state = self._state(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        hashes = state.hashes
        cached = self._cached
        for i in range(max_hit_blocks):
            h = hashes[i] if i < len(hashes) else self._hash_block(request, state)
            block = cached.get(h)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        if record_stats:
            self.record_query(request.num_tokens, num_hit_tokens)
        return hits, num_hit_tokens

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup (tokens asked for, tokens found)."""
        self._num_queries += num_query_tokens
        self._num_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        The request's KV then covers `request.num_computed_tokens`, plus the tokens of
        `new_computed_blocks` (a prefix-cache hit from `get_computed_blocks`, only for a
        request that holds no blocks), plus `num_new_tokens`. Blocks that this makes
        full are hashed and registered in the prefix cache now.

        :returns: the newly allocated block ids (not the hit blocks), or None — with
            nothing changed — when there are not enough free blocks.
        """
        bs = self.block_size
        state = self._requests.get(request.request_id)
        if state is not None and not new_computed_blocks:
            # Fast path (most decodes): the tokens fit the last block and fill none.
            num_total = request.num_computed_tokens + num_new_tokens
            # speculative proposals are scheduled past the known tokens: never hashed
            num_known = min(num_total, request.num_tokens)
            if num_total <= len(state.block_ids) * bs and (num_known // bs <= state.num_registered or not self.enable_caching):
                return []
        num_held = len(state.block_ids) if state is not None else 0
        if new_computed_blocks and num_held:
            raise RuntimeError(f"request {request.request_id}: prefix-cache hits are only for a request that holds no blocks")
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        num_total = num_computed + num_new_tokens
        num_needed = -(-num_total // bs) - num_held - len(new_computed_blocks)
        ref_cnt = self._ref_cnt
        if num_needed > 0 or new_computed_blocks:
            # Hit blocks that sit in the free pool stop being free once taken.
            num_free_hits = sum(1 for b in new_computed_blocks if ref_cnt[b] == 0)
            if num_needed > self.num_free_blocks - num_free_hits:
                return None
        if state is None:
            state = self._state(request)
        if new_computed_blocks:
            for b in new_computed_blocks:
                if ref_cnt[b] == 0:
                    del self._free_cached[b]
                ref_cnt[b] += 1
            state.block_ids.extend(new_computed_blocks)
            state.num_registered = max(state.num_registered, len(new_computed_blocks))
        new_blocks = [self._pop_free() for _ in range(num_needed)] if num_needed > 0 else []
        if new_blocks:
            state.block_ids.extend(new_blocks)
        if self.enable_caching:
            num_full = min(num_total, request.num_tokens) // bs
            if num_full > state.num_registered:
                self._register(request, state, num_full)
        return new_blocks

    def _pop_free(self) -> int:
        if self._free_uncached:
            block = self._free_uncached.popleft()
        else:
            block, _ = self._free_cached.popitem(last=False)
            self._uncache(block)
        self._ref_cnt[block] = 1
        return block

    def _uncache(self, block: int) -> None:
        h = self._block_hash[block]
        if h is not None:
            if self._cached.get(h) == block:
                del self._cached[h]
            self._block_hash[block] = None

    def _register(self, request: Request, state: _RequestBlocks, num_full: int) -> None:
        hashes = state.hashes
        cached = self._cached
        block_hash = self._block_hash
        for i in range(state.num_registered, num_full):
            h = hashes[i] if i < len(hashes) else self._hash_block(request, state)
            block = state.block_ids[i]
            # An equal prefix computed twice (two requests admitted before either was
            # registered) keeps the first block; the duplicate stays unhashed and is
            # recycled first when freed.
            if block_hash[block] is None and h not in cached:
                block_hash[block] = h
                cached[h] = block
        state.num_registered = num_full

    # ----- release -----------------------------------------------------------------

    def free(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Release every block of `request` (tail first) and forget its hashes.

        :param num_computed_tokens: pass it when the request is dropped from the step
            that allocated its latest blocks: hashed blocks at or after this token
            were never written and lose their hash instead of staying cached.
        """
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return
        first_unwritten = len(state.block_ids) if num_computed_tokens is None else num_computed_tokens // self.block_size
        ref_cnt = self._ref_cnt
        block_hash = self._block_hash
        blocks = state.block_ids
        for i in range(len(blocks) - 1, -1, -1):
            block = blocks[i]
            cnt = ref_cnt[block] - 1
            ref_cnt[block] = cnt
            if cnt:
                continue
            if i >= first_unwritten:
                self._uncache(block)
            if block_hash[block] is not None:
                self._free_cached[block] = None  # most recently used end
            else:
                self._free_uncached.append(block)

    def has_shared_uncomputed_blocks(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether another request holds one of this request's not-yet-written blocks
        (it hit a block registered this step): dropping this request from the step
        would leave that other request reading K/V nobody writes."""
        state = self._requests.get(request.request_id)
        if state is None:
            return False
        first = num_computed_tokens // self.block_size
        return any(self._ref_cnt[b] > 1 for b in state.block_ids[first:])

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (after a live weight update the cached K/V is stale).

        :returns: False, changing nothing, while any block is held by a request.
        """
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self._free_cached:
            self._block_hash[block] = None
            self._free_uncached.append(block)
        self._free_cached.clear()
        self._cached.clear()
        for state in self._requests.values():  # waiting requests' lookup state
            state.num_registered = 0
        return True

    # ----- debugging ---------------------------------------------------------------

    def consistency_errors(self) -> list[str]:
        """Internal invariants that do not hold (empty when consistent); for tests."""
        errors: list[str] = []
        first = 0 if self.null_block_id is None else 1
        holders = [0] * self.num_blocks
        for rid, state in self._requests.items():
            if len(set(state.block_ids)) != len(state.block_ids):
                errors.append(f"{rid} holds a block twice")
            for b in state.block_ids:
                holders[b] += 1
        free_u, free_c = set(self._free_uncached), set(self._free_cached)
        if len(free_u) != len(self._free_uncached):
            errors.append("a block is twice in the uncached free pool")
        if free_u & free_c:
            errors.append(f"blocks in both free pools: {sorted(free_u & free_c)}")
        for b in range(first, self.num_blocks):
            if holders[b] != self._ref_cnt[b]:
                errors.append(f"block {b}: ref count {self._ref_cnt[b]} but {holders[b]} holders")
            is_free = b in free_u or b in free_c
            if is_free != (self._ref_cnt[b] == 0):
                errors.append(f"block {b}: ref count {self._ref_cnt[b]} but free={is_free}")
            if b in free_c and self._block_hash[b] is None:
                errors.append(f"block {b} is cached-free without a hash")
            if b in free_u and self._block_hash[b] is not None:
                errors.append(f"block {b} is uncached-free with a hash")
        if self.null_block_id is not None and (self._ref_cnt[0] or 0 in free_u or 0 in free_c):
            errors.append("the null block was handed out")
        for h, b in self._cached.items():
            if self._block_hash[b] != h:
                errors.append(f"cache map points at block {b}, which holds another hash")
        if len(free_u) + len(free_c) + sum(1 for b in range(first, self.num_blocks) if self._ref_cnt[b]) != self.num_usable_blocks:
            errors.append("free + used != total")
        return errors


def _skips_cache_read(request: Request) -> bool:
    params = request.sampling_params
    return params is not None and params.prompt_logprobs is not None
