"""Argument checks shared by the runtime and the handler context, and one trigger call's
options (``TriggerOptions``), carried whole from ``trigger``, ``trigger_many`` and
``context.trigger_child`` to where they are checked and turned into rows, so the list of
options is written once.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypedDict

import attrs

from runlane._codec import exception_text
from runlane._limits import MAX_TEXT_BYTES, MAX_TEXT_CHARS
from runlane.errors import ConfigurationError, RunNotFound, WaitTokenNotFound
from runlane.flow import Queue
from runlane.toolkit import INT32_MAX, MAX_DURATION, as_int32, clipped, shown

__all__ = [
    "DEFAULT_OPTIONS",
    "DEFAULT_QUEUE",
    "INT32_MAX",
    "MAX_DURATION",
    "ChildTriggerOptions",
    "TriggerOptions",
    "as_duration",
    "as_int32",
    "as_moment",
    "as_payload_list",
    "as_run_at",
    "check_idempotency_key",
    "check_text",
    "child_options",
    "run_key",
    "token_key",
    "with_default_queue",
]

DEFAULT_QUEUE = "default"

# runlane's own keys (steps of sleeps, children's idempotency keys) start with this; names and
# keys the user gives must not
RESERVED_PREFIX = "runlane."

_EARLIEST_RUN_AT = datetime(1970, 1, 1, tzinfo=UTC)


def as_duration(name: str, value: timedelta | float | int | None) -> timedelta:
    """A non-negative, finite duration from a timedelta or a number of seconds (None: 0)."""
    if value is None:
        return timedelta(0)
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise ConfigurationError(
            f"{name} must be a timedelta or a number of seconds, got {shown(value)}"
        )
    limit = MAX_DURATION.total_seconds()
    if isinstance(value, int) and abs(value) > limit:
        # an int too large for a float (10**400) fails both isfinite() and timedelta()
        bound = (
            "must not be negative"
            if value < 0
            else f"must be at most 100 years ({limit:.0f} seconds)"
        )
        raise ConfigurationError(f"{name} {bound}, got {shown(value)}")
    if not isinstance(value, timedelta) and not math.isfinite(value):
        raise ConfigurationError(f"{name} must be a finite number of seconds, got {shown(value)}")
    try:
        delta = value if isinstance(value, timedelta) else timedelta(seconds=value)
    except OverflowError as exc:
        raise ConfigurationError(
            f"{name} must be at most 100 years ({limit:.0f} seconds), got {shown(value)}"
        ) from exc
    if delta < timedelta(0):
        # str() of a negative timedelta reads "-1 day, 23:59:55": say it in seconds
        raise ConfigurationError(
            f"{name} must not be negative, got {delta.total_seconds():g} seconds"
        )
    if delta > MAX_DURATION:
        raise ConfigurationError(
            f"{name} must be at most 100 years ({MAX_DURATION.total_seconds():.0f} seconds), "
            f"got {delta.total_seconds():g} seconds"
        )
    return delta


def as_moment(name: str, value: object) -> datetime | None:
    """None, or a timezone-aware datetime (a filter's bound)."""
    if value is None:
        return None
    if not isinstance(value, datetime) or value.utcoffset() is None:
        raise ConfigurationError(
            f"{name} must be a timezone-aware datetime (e.g. datetime.now(UTC) - "
            f"timedelta(hours=1)), got {shown(value)}"
        )
    return value


def as_run_at(value: object) -> datetime:
    """A timezone-aware datetime from 1970 to 100 years from now, in UTC."""
    aware = "run_at must be a timezone-aware datetime (e.g. datetime.now(UTC) + timedelta(hours=1))"
    if not isinstance(value, datetime):
        raise ConfigurationError(f"{aware}, got {shown(value)}")
    try:  # a user tzinfo's utcoffset() may raise anything, or return what is no offset
        offset = value.utcoffset()
    except Exception as exc:
        raise _tzinfo_failed(value, exc) from exc
    if offset is None:
        raise ConfigurationError(f"{aware}, got {shown(value)}")
    try:
        utc = value.astimezone(UTC)
    except OverflowError as exc:
        raise ConfigurationError(f"run_at {shown(value)} is out of range") from exc
    except Exception as exc:
        raise _tzinfo_failed(value, exc) from exc
    if not _EARLIEST_RUN_AT <= utc <= datetime.now(UTC) + MAX_DURATION:
        raise ConfigurationError(
            f"run_at must be from 1970 to 100 years from now, got {utc.isoformat()}; "
            "a run due in the past is due at once"
        )
    return utc


def _tzinfo_failed(value: datetime, exc: Exception) -> ConfigurationError:
    return ConfigurationError(
        f"run_at's tzinfo ({type(value.tzinfo).__name__}) failed to give its offset from UTC "
        f"({type(exc).__name__}: {clipped(exception_text(exc))}); use datetime.UTC, "
        "datetime.timezone(timedelta(hours=...)) or zoneinfo.ZoneInfo(...)"
    )


def check_text(name: str, value: object, max_chars: int = MAX_TEXT_CHARS) -> str:
    """A non-empty string that Postgres text can hold: at most ``max_chars`` characters and
    MAX_TEXT_BYTES bytes in UTF-8, no NUL character, no lone surrogate."""
    if not isinstance(value, str) or not value or len(value) > max_chars:
        raise ConfigurationError(
            f"{name} must be a non-empty string of at most {max_chars} characters, got "
            f"{shown(value)}"
        )
    if not value.isascii():
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise ConfigurationError(
                f"{name} must be valid Unicode text; {shown(value)} holds {value[exc.start]!r}, a "
                "lone surrogate (decode bytes with errors='replace', or pick another value)"
            ) from None
        if size > MAX_TEXT_BYTES:
            raise ConfigurationError(
                f"{name} must be at most {MAX_TEXT_BYTES:,} bytes in UTF-8 (what its index "
                f"can hold), got a string of {len(value):,} characters in {size:,} bytes"
            )
    if "\x00" in value:
        raise ConfigurationError(
            f"{name} must not contain the NUL character (\\x00), which Postgres text cannot "
            f"hold: got {shown(value)}"
        )
    return value


def check_idempotency_key(value: object) -> str:
    """An idempotency key the user gives, at every entrance that takes one (``trigger``,
    ``trigger_many``, ``context.trigger_child``, ``trigger_schedule_now`` and the console's
    *Run now*, ``create_wait_token``): text Postgres can hold, outside runlane's key space (a
    caller holding a child's derived key could pose as that child, or make its parent fail)."""
    key = check_text("idempotency_key", value)
    if key.startswith(RESERVED_PREFIX):
        raise ConfigurationError(
            f"idempotency keys starting with {RESERVED_PREFIX!r} are reserved for runlane's "
            f"own keys (context.trigger_child derives them): got {shown(key)}; pick a key "
            "without that prefix"
        )
    return key


def as_payload_list(payloads: object) -> list[Any]:
    """``trigger_many``'s payloads as a list: one payload per item of a list, tuple or other
    iterable; a string, bytes or mapping is refused (iterating it is not what was meant)."""
    if isinstance(payloads, str | bytes | bytearray | Mapping) or not isinstance(
        payloads, Iterable
    ):
        raise ConfigurationError(
            f"trigger_many takes a list of payloads, got {type(payloads).__name__}; to trigger "
            "one run, call trigger(task, payload) or pass [payload]"
        )
    return list(payloads)


def run_key(run_id: uuid.UUID | str) -> uuid.UUID:
    try:
        return run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    except ValueError as exc:
        raise RunNotFound(
            f"{run_id!r} is not a run id (a UUID): pass RunHandle.id, or an id that "
            "`runlane runs list` printed"
        ) from exc


def token_key(token_id: uuid.UUID | str) -> uuid.UUID:
    try:
        return token_id if isinstance(token_id, uuid.UUID) else uuid.UUID(str(token_id))
    except ValueError as exc:
        raise WaitTokenNotFound(
            f"{token_id!r} is not a wait token id (a UUID): pass the WaitToken.id that "
            "create_wait_token() returned"
        ) from exc


def with_default_queue(queues: Sequence[Queue]) -> list[Queue]:
    """Check the queue definitions; mark or add the default queue."""
    queue_list = list(queues)
    for q in queue_list:
        if not isinstance(q, Queue):
            raise ConfigurationError(f"queues takes queue(...) definitions, got {shown(q)}")
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
        return [attrs.evolve(q, default=True) if q.name == DEFAULT_QUEUE else q for q in queue_list]
    return [*queue_list, Queue(name=DEFAULT_QUEUE, default=True)]


@attrs.frozen
class TriggerOptions:
    """What a trigger call says about its runs besides the payloads and idempotency keys
    (one key per payload): every run of the call shares these. Values are as the caller
    gave them; the runtime checks them (``runtime._triggering``) before anything is written."""

    queue: str | None = None
    delay: timedelta | float | None = None
    run_at: datetime | None = None
    priority: int = 0
    max_attempts: int | None = None
    concurrency_key: str | None = None
    # set by context.trigger_child: the run that triggers (not a caller's option)
    parent_run_id: uuid.UUID | None = None

    @classmethod
    def of(cls, *given: Any) -> TriggerOptions:
        """A trigger call's options in field order: the shared ``DEFAULT_OPTIONS`` when each
        is at its default (a bool priority is not: the checks refuse it), so the runtime
        finds the plan it checked for the task's defaults without building anything."""
        queue, delay, run_at, priority, max_attempts, key = given
        unset = queue is None and delay is None and run_at is None and max_attempts is None
        if unset and key is None and type(priority) is int and priority == 0:
            return DEFAULT_OPTIONS
        return cls(*given)


#: the options of a call that gave none
DEFAULT_OPTIONS = TriggerOptions()


class ChildTriggerOptions(TypedDict, total=False):
    """The keyword arguments ``context.trigger_child`` takes: ``trigger``'s, without
    ``connection`` (a child is written on the runtime's own connections)."""

    queue: str | None
    delay: timedelta | float | None
    run_at: datetime | None
    idempotency_key: str | None
    priority: int
    max_attempts: int | None
    concurrency_key: str | None


_CHILD_KEYS = frozenset(ChildTriggerOptions.__annotations__) - {"idempotency_key"}


def child_options(options: Mapping[str, object], parent_run_id: uuid.UUID) -> TriggerOptions:
    """The TriggerOptions of a ``trigger_child`` call (its ``idempotency_key`` taken out
    already); an option it does not take raises ConfigurationError, nothing written."""
    unknown = sorted(set(options) - _CHILD_KEYS)
    if unknown:
        raise ConfigurationError(
            f"trigger_child got unknown options {unknown}; it takes "
            f"{sorted(_CHILD_KEYS | {'idempotency_key'})}"
        )
    return TriggerOptions(parent_run_id=parent_run_id, **options)  # type: ignore[arg-type]
