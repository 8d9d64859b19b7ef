"""Counting the statements this process sends to Postgres, for "statements per run".

On a real network each statement is a round trip (several pipelined ones share one, which
runlane does only for batches split across statements), so statements per run decide
throughput at 1 ms RTT more than anything measured on loopback. The count wraps psycopg's
``Cursor.execute`` and ``Cursor.executemany`` (``Connection.execute`` goes through the
former) for as long as the context is open, in every thread of the process: the worker's
claims, completions and lease extensions, the triggers, the listener's ``LISTEN``. It sees
only this process's statements, not those of worker processes it starts.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import psycopg

__all__ = ["StatementCount", "counting_statements"]


class StatementCount:
    """Statements sent since the context opened; ``per`` divides a stretch by its runs."""

    def __init__(self, skipped: int | None) -> None:
        self._lock = threading.Lock()
        self._skipped = skipped
        self.value = 0

    def add(self) -> None:
        if threading.get_ident() == self._skipped:
            return
        with self._lock:
            self.value += 1

    def per(self, runs: int, since: int = 0) -> float:
        """Statements per run since the reading ``since``."""
        return (self.value - since) / runs if runs else 0.0


@contextlib.contextmanager
def counting_statements(*, skip_this_thread: bool = False) -> Iterator[StatementCount]:
    """Count every statement psycopg sends in this process while open; with
    ``skip_this_thread``, not those of the calling thread (a benchmark's own polling)."""
    count = StatementCount(threading.get_ident() if skip_this_thread else None)
    execute = psycopg.Cursor.execute
    executemany = psycopg.Cursor.executemany

    def counted_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        count.add()
        return execute(self, *args, **kwargs)

    def counted_executemany(self: Any, *args: Any, **kwargs: Any) -> Any:
        count.add()
        return executemany(self, *args, **kwargs)

    psycopg.Cursor.execute = counted_execute  # type: ignore[method-assign]
    psycopg.Cursor.executemany = counted_executemany  # type: ignore[method-assign]
    try:
        yield count
    finally:
        psycopg.Cursor.execute = execute  # type: ignore[method-assign]
        psycopg.Cursor.executemany = executemany  # type: ignore[method-assign]
