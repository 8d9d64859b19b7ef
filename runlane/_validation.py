"""Argument checks shared by the runtime and the handler context."""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from datetime import timedelta

from runlane.errors import ConfigurationError, RunNotFound, WaitTokenNotFound
from runlane.tasks import Queue

__all__ = ["DEFAULT_QUEUE", "as_duration", "run_key", "token_key", "with_default_queue"]

DEFAULT_QUEUE = "default"


def as_duration(name: str, value: timedelta | float | int | None) -> timedelta:
    """A non-negative, finite duration from a timedelta or a number of seconds (None: 0)."""
    if value is None:
        return timedelta(0)
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise ConfigurationError(
            f"{name} must be a timedelta or a number of seconds, got {value!r}"
        )
    if not isinstance(value, timedelta) and not math.isfinite(value):
        raise ConfigurationError(f"{name} must be a finite number of seconds, got {value!r}")
    try:
        delta = value if isinstance(value, timedelta) else timedelta(seconds=value)
    except OverflowError as exc:
        raise ConfigurationError(f"{name} is too large: {value!r}") from exc
    if delta < timedelta(0):
        # str() of a negative timedelta reads "-1 day, 23:59:55": say it in seconds
        raise ConfigurationError(
            f"{name} must not be negative, got {delta.total_seconds():g} seconds"
        )
    return delta


def run_key(run_id: uuid.UUID | str) -> uuid.UUID:
    try:
        return run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    except ValueError as exc:
        raise RunNotFound(f"{run_id!r} is not a run id (a UUID)") from exc


def token_key(token_id: uuid.UUID | str) -> uuid.UUID:
    try:
        return token_id if isinstance(token_id, uuid.UUID) else uuid.UUID(str(token_id))
    except ValueError as exc:
        raise WaitTokenNotFound(f"{token_id!r} is not a wait token id (a UUID)") from exc


def with_default_queue(queues: Sequence[Queue]) -> list[Queue]:
    """Check the queue definitions; mark or add the default queue."""
    queue_list = list(queues)
    for q in queue_list:
        if not isinstance(q, Queue):
            raise ConfigurationError(f"queues takes queue(...) definitions, got {q!r}")
    names = [q.name for q in queue_list]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigurationError(f"queues registered twice: {duplicates}")
    defaults = [q.name for q in queue_list if q.default]
    if len(defaults) > 1:
        raise ConfigurationError(f"only one queue may be the default, got {defaults}")
    if defaults:
        return queue_list
    if DEFAULT_QUEUE in names:
        return [
            Queue(q.name, True, q.concurrency_limit) if q.name == DEFAULT_QUEUE else q
            for q in queue_list
        ]
    return [*queue_list, Queue(name=DEFAULT_QUEUE, default=True)]
