"""Jittered exponential backoff for reconnecting loops and retries: the one back-off of the
acquirers, the writer, the listener, the RabbitMQ consumer and publisher, and the storage's
retry of a statement whose connection broke."""

from __future__ import annotations

import random
import threading

__all__ = ["Backoff"]

# a private generator: the global one belongs to the application (and to test tools)
_random = random.Random()


class Backoff:
    """Delays from ``first`` (50 ms) growing ``factor`` times (doubling) up to ``cap``
    seconds, each spread over its lower half."""

    def __init__(self, first: float = 0.05, cap: float = 5.0, factor: float = 2.0) -> None:
        self._first = first
        self._cap = cap
        self._factor = factor
        self._delay = first
        self._lock = threading.Lock()

    def next(self) -> float:
        with self._lock:
            delay, self._delay = self._delay, min(self._delay * self._factor, self._cap)
        return delay * _random.uniform(0.5, 1.0)

    def reset(self) -> None:
        with self._lock:
            self._delay = self._first
