"""Batching of concurrent point reads: many threads asking for runs at once share a query.

No thread waits for a timer. The first caller of a quiet batcher becomes the leader and reads
what is pending at once; callers arriving meanwhile queue up, and when the leader's read is
done one of them leads the next read for the whole queue. A single caller therefore pays one
round trip as usual, while N concurrent callers pay about two queries instead of N.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

__all__ = ["PointReads"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Waiter(Generic[V]):
    __slots__ = ("error", "event", "lead", "result")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.lead = False
        self.result: V | None = None
        self.error: BaseException | None = None

    def outcome(self) -> V | None:
        if self.error is not None:
            raise self.error
        return self.result


class PointReads(Generic[K, V]):
    """Reads by key through ``fetch_many``, merging the reads of concurrent callers."""

    def __init__(self, fetch_many: Callable[[Sequence[K]], dict[K, V]]) -> None:
        self._fetch_many = fetch_many
        self._lock = threading.Lock()
        self._pending: dict[K, list[_Waiter[V]]] = {}
        self._leading = False
        self.queries = 0  # how many reads were made, for tests and metrics

    def get(self, key: K) -> V | None:
        waiter: _Waiter[V] = _Waiter()
        with self._lock:
            self._pending.setdefault(key, []).append(waiter)
            if not self._leading:
                self._leading = waiter.lead = True
        if not waiter.lead:
            waiter.event.wait()
            if not waiter.lead:
                return waiter.outcome()
        self._lead(waiter)
        return waiter.outcome()

    def _lead(self, me: _Waiter[V]) -> None:
        with self._lock:
            batch, self._pending = self._pending, {}
            self.queries += 1
        try:
            found = self._fetch_many(list(batch))
        except BaseException as exc:
            for waiters in batch.values():
                for waiter in waiters:
                    waiter.error = exc
        else:
            for key, waiters in batch.items():
                for waiter in waiters:
                    waiter.result = found.get(key)
        with self._lock:
            if self._pending:
                # the next read is led by one of the callers that queued meanwhile
                successor = next(iter(self._pending.values()))[0]
                successor.lead = True
                successor.event.set()
            else:
                self._leading = False
        for waiters in batch.values():
            for waiter in waiters:
                if waiter is not me:
                    waiter.event.set()
