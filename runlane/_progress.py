"""Progress a handler reports (``RunContext.report_progress``): checked and encoded here,
written by the worker's lifecycle writer.

The writer batches every slot's progress with its other fenced writes (no round trip in the
handler's thread), at most once a second per attempt: a report inside the second replaces
the one pending (the last value wins) and is written when the second has passed, or just
before the attempt's completion, failure or hand-back in the same batch, or at close. A
write whose attempt no longer holds its lease changes nothing and marks the attempt stale:
its next report raises StaleLease.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import attrs

from runlane._codec import OutputNotSerializable, dump_json, encode_plain
from runlane._display import shown
from runlane.errors import ConfigurationError
from runlane.storage import LeaseRef

__all__ = [
    "MAX_MESSAGE_CHARS",
    "THROTTLE_SECONDS",
    "AttemptProgress",
    "ProgressSink",
    "encode_progress",
]

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
