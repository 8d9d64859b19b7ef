"""Closing in parts: every part runs even when one before it raised, and the first error is
raised once all have run.

A close that stopped at its first failing part left the parts after it running: a raw
``OverflowError`` from one thread's ``join`` left the writer, the listener and the pool's
threads of a worker alive, and the runtime's connections open.

A close's waits share one :class:`Deadline`: a close that gave each of its waits the full
timeout took a multiple of it when several parts stalled at once (a broker and a database
that stopped answering).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Closing", "Deadline"]

log = logging.getLogger("runlane")


class Closing:
    """The parts of one close: ``with closing.part("the writer"): ...`` for each, then
    ``closing.raise_first()``. A part's error (even a ``KeyboardInterrupt``) is kept, not
    raised, so the next parts still run; errors after the first are logged."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._first: BaseException | None = None

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        try:
            yield
        except BaseException as exc:
            if self._first is None:
                self._first = exc
            else:
                log.warning(
                    "runlane: closing %s: %s failed as well", self._what, name, exc_info=True
                )

    def raise_first(self) -> None:
        """Raise the first part's error, if any part failed."""
        first, self._first = self._first, None
        if first is not None:
            raise first


class Deadline:
    """One bound shared by every wait of a close: each wait gets what is left of it.
    ``None`` (no timeout) leaves every wait unbounded."""

    def __init__(self, timeout: float | None) -> None:
        self._end = None if timeout is None else time.monotonic() + timeout

    def left(self, floor: float = 0.0) -> float | None:
        """Seconds left (at least ``floor``), or None without a timeout."""
        return None if self._end is None else max(floor, self._end - time.monotonic())
