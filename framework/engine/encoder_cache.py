"""The scheduler's record of the runner's encoder cache (vLLM v1's scheme).

The vision encoder's output for an image is computed once and kept by the model
runner, keyed by the image's content hash, until the scheduler says to drop it. The
scheduler decides everything here, so both sides agree without a round trip:

- an image is encoded in the step whose prefill chunk first reaches its placeholders,
  if the step's encoder budget and the cache's capacity (both in embeddings) allow;
  otherwise the chunk stops before the image and the request continues next step;
- a request holds a reference to each image it is still consuming; an image nobody
  references stays cached (a repeated image is encoded once) and is evicted least
  recently used when room is needed, the runner told with the next step.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"encoder cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._sizes: dict[str, int] = {}
        self._refs: dict[str, set[str]] = {}
        # unreferenced entries, least recently used first: the eviction candidates
        self._idle: OrderedDict[str, None] = OrderedDict()
        self._freed: list[str] = []
        self.num_encoded = 0  # images scheduled for encoding (cache misses)
        self.num_hits = 0  # image uses served from the cache

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def evictable(self, keep=frozenset()) -> int:
        return sum(self._sizes[k] for k in self._idle if k not in keep)

    def can_allocate(self, size: int, pending: int = 0, keep=frozenset()) -> bool:
        """Whether `size` more (after `pending` already planned this step) fits by evicting
        idle entries other than `keep` (those about to be referenced)."""
        return self.capacity - self.used + self.evictable(keep) >= size + pending

    def allocate(self, key: str, size: int, req_id: str) -> None:
        while self.capacity - self.used < size:
            victim, _ = self._idle.popitem(last=False)
            self.used -= self._sizes.pop(victim)
            self._refs.pop(victim, None)
            self._freed.append(victim)
        self._sizes[key] = size
        self.used += size
        self._refs[key] = {req_id}
        self.num_encoded += 1

    def reference(self, key: str, req_id: str) -> None:
        refs = self._refs.setdefault(key, set())
        if req_id not in refs:
            self.num_hits += 1
            refs.add(req_id)
        self._idle.pop(key, None)

    def release(self, req_id: str, key: str | None = None, keys=()) -> None:
        """Drop `req_id`'s reference to `key` (or to each of `keys`)."""
        for k in (key,) if key is not None else keys:
            refs = self._refs.get(k)
            if refs is None or req_id not in refs:
                continue
            refs.discard(req_id)
            if not refs:
                self._idle[k] = None
                self._idle.move_to_end(k)

    def plan(self, features, start: int, num_new: int, budget: int) -> tuple[int, tuple[list, list]]:
        """How many of `num_new` tokens from `start` can run given the images they reach
        and `budget` embeddings left to encode this step: (tokens, (features to encode,
        features read from the cache)). Nothing is committed (KV blocks may be refused)."""
        encode: list = []
        use: list = []
        pending = 0
        for feature in features:
            if not feature.overlaps(start, start + num_new):
                continue
            if feature.hash in self or any(f.hash == feature.hash for f in encode):
                use.append(feature)
                continue
            keep = {f.hash for f in use}
            if pending + feature.length <= budget and self.can_allocate(feature.length, pending, keep):
                encode.append(feature)
                pending += feature.length
                continue
            num_new = feature.offset - start  # stop before this image: it is encoded in a later step
            break
        return num_new, (encode, use)

    def commit(self, req_id: str, plan: tuple[list, list]) -> list:
        """Apply a plan for `req_id`; returns the features the runner must encode."""
        encode, use = plan
        for feature in use:
            self.reference(feature.hash, req_id)
        for feature in encode:
            self.allocate(feature.hash, feature.length, req_id)
        return list(encode)

    def take_freed(self) -> tuple[str, ...]:
        freed, self._freed = tuple(self._freed), []
        return freed

    def reset(self) -> None:
        """Forget every idle entry (the runner is told to drop them)."""
        for k in list(self._idle):
            self.used -= self._sizes.pop(k)
            self._refs.pop(k, None)
            self._freed.append(k)
        self._idle.clear()
