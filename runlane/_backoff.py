"""Jittered exponential backoff for reconnecting loops (acquirers, the writer, the listener)."""

from __future__ import annotations

import random
import threading

__all__ = ["Backoff"]

# a private generator: the global one belongs to the application (and to test tools)
_random = random.Random()


class Backoff:
    """Delays of 50 ms doubling up to ``cap`` seconds, each spread over its lower half."""

    def __init__(self, first: float = 0.05, cap: float = 5.0) -> None:
        self._first = first
        self._cap = cap
        self._delay = first
        self._lock = threading.Lock()

    def next(self) -> float:
        with self._lock:
            delay, self._delay = self._delay, min(self._delay * 2, self._cap)
        return delay * _random.uniform(0.5, 1.0)

    def reset(self) -> None:
        with self._lock:
            self._delay = self._first
