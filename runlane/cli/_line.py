"""A progress line on stderr: rewritten in place, at most ten times a second, and only on a
terminal (``runlane drain``, bulk ``runs retry|cancel|delete``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

__all__ = ["ProgressLine"]

_INTERVAL = 0.1


class ProgressLine:
    """``show(text)`` rewrites the line unless it was rewritten less than 0.1 s ago;
    ``finish()`` ends it with a newline if anything was shown. ``before_write`` runs before
    each write (the CLI writes the log lines queued so far first)."""

    def __init__(self, before_write: Callable[[], None] | None = None) -> None:
        self._before_write = before_write
        self._tty = sys.stderr.isatty()
        self._shown = 0.0
        self._written = False

    def show(self, text: str) -> None:
        now = time.monotonic()
        if not self._tty or now - self._shown < _INTERVAL:
            return
        self._shown = now
        self._written = True
        self._write(f"\r{text}")

    def finish(self) -> None:
        if self._written:
            self._write("\n")

    def _write(self, text: str) -> None:
        if self._before_write is not None:
            self._before_write()
        sys.stderr.write(text)
        sys.stderr.flush()
