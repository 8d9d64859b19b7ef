"""Closing in parts: every part runs even when one before it raised, and the first error is
raised once all have run.

A close that stopped at its first failing part left the parts after it running: a raw
``OverflowError`` from one thread's ``join`` left the writer, the listener and the pool's
threads of a worker alive, and the runtime's connections open.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Closing"]

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
