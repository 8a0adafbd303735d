"""The scheduler's waiting queues: first come first served, or by priority.

Both answer the same calls (push, push_preempted, peek, pop, remove, len, iteration in
serving order), so the scheduler does not know which policy it runs.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from .request import Request


class FcfsQueue:
    """Waiting requests in arrival order; preempted ones go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._q.append(request)

    def push_preempted(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Waiting requests by (priority, arrival time, order added)."""

    def __init__(self, key) -> None:
        self._heap: list[tuple[tuple, Request]] = []
        self._key = key

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._key(request), request))

    # A preempted request keeps its original key, which puts it ahead of later arrivals.
    push_preempted = push

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[1] for e in sorted(self._heap, key=lambda e: e[0]))
