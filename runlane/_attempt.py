"""The engine's side of one attempt's :class:`~runlane.RunContext`: its control and its
progress.

The worker hands each attempt's :class:`AttemptControl` to its context: the worker asks the
attempt to stop through it, the context's durable operations record a database outage they
met, and the executor asks whether a handler's exception came from one. Progress is
checked and encoded here; the lifecycle writer writes it at most once a second per attempt
(the last value wins), fenced: once the lease is lost the next report raises StaleLease.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Protocol

import attrs

from runlane._codec import OutputNotSerializable, dump_json, encode_plain
from runlane.errors import ConfigurationError, StopReason, StorageUnavailable
from runlane.storage import LeaseRef
from runlane.toolkit import shown

__all__ = [
    "MAX_MESSAGE_CHARS",
    "THROTTLE_SECONDS",
    "AttemptControl",
    "AttemptProgress",
    "ProgressSink",
    "encode_progress",
]


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


# at most one progress write a second per attempt
THROTTLE_SECONDS = 1.0
MAX_MESSAGE_CHARS = 1_000


@attrs.define(eq=False)
class AttemptProgress:
    """One attempt's progress as its writer keeps it (guarded by the writer's lock)."""

    lease: LeaseRef
    pending: str | None = None  # JSON text not yet written: the last value reported
    last_written: float = -math.inf  # time.monotonic() of the last write
    stale: bool = False  # a write found the attempt no longer holds its lease


class ProgressSink(Protocol):
    """Where a context hands its progress (the worker's lifecycle writer)."""

    def progress(self, attempt: AttemptProgress, value: str) -> None: ...


def _fraction(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(
            f"report_progress(fraction=...) takes a number from 0 to 1 (0.25 for a quarter "
            f"done), got {shown(value)}; nothing was written"
        )
    try:
        number = float(value)
    except OverflowError:  # an int past a float's range: not from 0 to 1 either
        number = math.inf
    if not math.isfinite(number) or not 0.0 <= number <= 1.0:
        raise ConfigurationError(
            f"report_progress(fraction=...) must be from 0 to 1 (0.25 for a quarter done), "
            f"got {shown(value)}; nothing was written"
        )
    return number


def _message(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigurationError(
            f"report_progress(message=...) takes a string, got {shown(value)}; nothing was written"
        )
    if len(value) > MAX_MESSAGE_CHARS:
        raise ConfigurationError(
            f"report_progress(message=...) takes at most {MAX_MESSAGE_CHARS:,} characters, got "
            f"{len(value):,}; put details in data=, and keep the message a short line; "
            "nothing was written"
        )
    return value


def encode_progress(fraction: object, message: object, data: object, max_bytes: int) -> str:
    """The JSON text stored as the run's progress: ``{"fraction", "message", "data"}``; a
    ConfigurationError naming the fix for a value that cannot be stored."""
    checked_fraction = _fraction(fraction)
    checked_message = _message(message)
    try:
        data_text = encode_plain(data, max_bytes, what="report_progress(data=...)")
    except OutputNotSerializable as exc:
        raise ConfigurationError(f"{exc}; nothing was written") from exc
    head: dict[str, Any] = {"fraction": checked_fraction, "message": checked_message}
    # data is JSON text already: splice it in rather than decode and encode it again
    try:
        text = dump_json(head)
    except ValueError as exc:  # a NUL character or a lone surrogate in the message
        raise ConfigurationError(
            f"report_progress(message=...) cannot be stored ({exc}); nothing was written"
        ) from exc
    return f'{text[:-1]},"data":{data_text}}}'
