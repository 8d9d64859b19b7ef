"""The engine's side of one attempt's :class:`~runlane.RunContext`.

The worker makes an :class:`AttemptControl` for each attempt it starts and hands it to the
context; both then share it: the worker (through its lease tracker) asks the attempt to
stop, the context's durable operations record a database outage they met, and the executor
asks whether a handler's exception came from one. Neither reads the other's private state.
"""

from __future__ import annotations

import threading

from runlane._progress import ProgressSink
from runlane.errors import StopReason, StorageUnavailable

__all__ = ["AttemptControl"]


class AttemptControl:
    """The stop asked of one attempt, the outage its durable operations met, and where its
    progress reports go. Thread-safe where it must be: ``request_stop`` comes from the
    worker's threads while the handler runs."""

    def __init__(
        self,
        cancelled: threading.Event | None = None,
        *,
        progress_sink: ProgressSink | None = None,
        lease_checked_at: float = 0.0,
    ) -> None:
        # the context's ``cancelled``: set with the first stop asked
        self.cancelled = threading.Event() if cancelled is None else cancelled
        self.stop_reason: StopReason | None = None
        self._lock = threading.Lock()
        # the last outage a durable operation of the context met (and raised)
        self.outage: StorageUnavailable | None = None
        # time.monotonic() when the worker last checked the claim's lease and started the
        # attempt (fault-injection tests tell a pause after that moment from a late start)
        self.lease_checked_at = lease_checked_at
        # report_progress: the worker's lifecycle writer (None: written at once)
        self.progress_sink = progress_sink

    def request_stop(self, reason: StopReason) -> None:
        """Ask the handler to stop; the first reason sticks."""
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = reason
        self.cancelled.set()

    def outage_behind(self, exc: BaseException) -> bool:
        """Whether ``exc`` is (or was caused by) the database outage a durable operation of
        the context met."""
        seen: set[int] = set()
        current: BaseException | None = exc
        while current is not None and id(current) not in seen:
            if current is self.outage:
                return True
            seen.add(id(current))
            current = current.__cause__ or current.__context__
        return False
