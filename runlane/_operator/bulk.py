"""Bulk actions by filter: ``retry_runs``, ``cancel_runs``, ``delete_runs``, and the
creation-time filters an operator types (the CLI's ``--created-after/--created-before``, the
console's fields).

Filters are checked before anything is touched; the matched runs are walked newest first in
batches of ``BATCH_SIZE``, each a short transaction that skips locked runs and changes its
runs as the single-run action does, so a re-run after an interruption finds only what is
left (docs/operating.md, Bulk actions). Filter times are compared by Postgres as given, never
converted to UTC in Python, where an instant outside years 1 to 9999 would overflow.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TypedDict

from runlane._operator.runs import optional_name
from runlane._validation import as_moment
from runlane.errors import ConfigurationError
from runlane.models import BulkResult, RunStatus
from runlane.storage import BulkFilter, Storage
from runlane.tasks import Task
from runlane.toolkit import as_int_or_none, shown

__all__ = [
    "BATCH_SIZE",
    "MAX_LIMIT",
    "MAX_RUN_IDS",
    "BulkFilters",
    "BulkProgress",
    "as_run_ids",
    "bulk_action",
    "bulk_filter",
    "filter_time_field",
    "filter_time_text",
    "parse_filter_time",
]

# runs per batch: measured (benchmarks/bulk_stall.py) to keep a claim's longest stall behind
# a retry batch well under 100 ms on a 2-core machine
BATCH_SIZE = 500
# the largest limit= (and the bound of an unlimited count)
MAX_LIMIT = 1_000_000_000
# the most run ids one call selects (run_ids=): a selection, not a filter for millions
MAX_RUN_IDS = 1_000

BulkProgress = Callable[[int, int], None]


class BulkFilters(TypedDict, total=False):
    """The keywords ``retry_runs``, ``cancel_runs`` and ``delete_runs`` take, every one
    optional: ``status`` (one or a list; the statuses the action applies to by default),
    ``task`` (a task or its id), ``queue``, ``created_after`` and ``created_before``
    (timezone-aware: runs created in ``[created_after, created_before)``), ``run_ids``
    (the selected runs: a non-empty list of at most ``MAX_RUN_IDS`` ids), ``limit`` (at
    most this many runs), ``dry_run`` (only count), ``all`` (act with no filter) and
    ``on_batch(done, matched)``."""

    status: RunStatus | str | Sequence[RunStatus | str] | None
    task: Task[Any, Any] | str | None
    queue: str | None
    created_after: datetime | None
    created_before: datetime | None
    run_ids: Sequence[uuid.UUID | str] | None
    limit: int | None
    dry_run: bool
    all: bool
    on_batch: BulkProgress | None
    reason: str | None  # recorded in the audit trail


# the statuses each action applies to, in the order it walks them
_ACTIONABLE = {
    "retry": (RunStatus.FAILED, RunStatus.CANCELLED),
    "cancel": (
        RunStatus.QUEUED,
        RunStatus.RETRYING,
        RunStatus.RELEASED,
        RunStatus.WAITING,
        RunStatus.RUNNING,
    ),
    "delete": (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED),
}
_WHY = {
    "retry": "only failed or cancelled runs can be retried",
    "cancel": (
        "only queued, retrying, released, waiting and running runs can be cancelled "
        "(a cancellation_requested run is being cancelled already)"
    ),
    "delete": (
        "only terminal runs (completed, failed, cancelled) can be deleted; cancel live "
        "runs first (cancel_runs) and delete them once they are cancelled"
    ),
}
_METHOD = {"retry": "retry_runs", "cancel": "cancel_runs", "delete": "delete_runs"}


def _statuses(action: str, status: object) -> tuple[RunStatus, ...]:
    allowed = _ACTIONABLE[action]
    if status is None:
        return allowed
    given: Iterable[object]
    if isinstance(status, str | RunStatus):
        given = [status]
    elif isinstance(status, list | tuple | set | frozenset) and status:
        given = status
    else:
        raise ConfigurationError(
            f"status must be a run status or a non-empty list of them, got {shown(status)}"
        )
    valid = ", ".join(s.value for s in RunStatus)
    chosen = []
    for item in given:
        try:
            value = item if isinstance(item, RunStatus) else RunStatus(str(item))
        except ValueError:
            raise ConfigurationError(
                f"status {shown(item)} is not a run status; use one of: {valid}"
            ) from None
        if value not in allowed:
            raise ConfigurationError(
                f"{_METHOD[action]}(status={value.value!r}): {_WHY[action]}; nothing was changed"
            )
        chosen.append(value)
    return tuple(s for s in allowed if s in chosen)


def _limit(value: object) -> int | None:
    return as_int_or_none("limit", value, 1, MAX_LIMIT)


def as_run_ids(value: object) -> tuple[uuid.UUID, ...] | None:
    """``run_ids=`` checked: None, or its distinct run ids in order (at most ``MAX_RUN_IDS``)."""
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ConfigurationError(
            f"run_ids must be a list of run ids, got {shown(value)}; nothing was changed"
        )
    items = list(value)
    if not items:
        raise ConfigurationError("run_ids is empty: select at least one run; nothing was changed")
    if len(items) > MAX_RUN_IDS:
        raise ConfigurationError(
            f"run_ids holds {len(items):,} ids, more than {MAX_RUN_IDS:,}: act on a selection "
            "at most that large, or by filter; nothing was changed"
        )
    keys: dict[uuid.UUID, None] = {}
    for item in items:
        try:
            keys[item if isinstance(item, uuid.UUID) else uuid.UUID(str(item))] = None
        except ValueError:
            raise ConfigurationError(
                f"run_ids: {shown(item)} is not a run id (a UUID); nothing was changed"
            ) from None
    return tuple(keys)


def bulk_filter(
    action: str, environment: str, filters: BulkFilters
) -> tuple[BulkFilter, int | None]:
    """Check a bulk action's arguments; the filter and the limit. An unknown keyword is
    refused, and so is a call without any filter unless ``all=True``."""
    unknown = sorted(set(filters) - BulkFilters.__optional_keys__)
    if unknown:
        raise ConfigurationError(
            f"{_METHOD[action]}() takes no keyword {', '.join(shown(k) for k in unknown)}; "
            f"its keywords are {', '.join(BulkFilters.__annotations__)}; nothing was changed"
        )
    status = filters.get("status")
    task = filters.get("task")
    queue = filters.get("queue")
    created_after = filters.get("created_after")
    created_before = filters.get("created_before")
    run_ids = filters.get("run_ids")
    all = filters.get("all", False)
    if not isinstance(all, bool):
        raise ConfigurationError(f"all must be True or False, got {shown(all)}")
    task_id = task if isinstance(task, str) or task is None else getattr(task, "id", task)
    runs = BulkFilter(
        environment=environment,
        statuses=_statuses(action, status),
        task_id=optional_name("task", task_id),
        queue=optional_name("queue", queue),
        created_after=as_moment("created_after", created_after),
        created_before=as_moment("created_before", created_before),
        run_ids=as_run_ids(run_ids),
    )
    bound = _limit(filters.get("limit"))
    # limit= bounds how many, not which: alone it is no filter
    filtered = any(
        v is not None for v in (status, task, queue, created_after, created_before, run_ids)
    )
    if not filtered and not all:
        raise ConfigurationError(
            f"{_METHOD[action]}() without a filter would act on every "
            f"{'/'.join(s.value for s in runs.statuses)} run of environment {environment!r}: "
            "pass a filter (status=, task=, queue=, created_after=, created_before=, "
            "run_ids=), "
            "or all=True to mean it; nothing was changed"
        )
    return runs, bound


def bulk_action(
    storage: Storage,
    action: str,
    runs: BulkFilter,
    limit: int | None,
    filters: BulkFilters,
) -> BulkResult:
    """Count the runs ``runs`` matches, then (unless ``filters`` say ``dry_run``) act on them
    in batches."""
    dry_run = filters.get("dry_run", False)
    on_batch = filters.get("on_batch")
    if not isinstance(dry_run, bool):
        raise ConfigurationError(f"dry_run must be True or False, got {shown(dry_run)}")
    if on_batch is not None and not callable(on_batch):
        raise ConfigurationError(
            f"on_batch must be a callable taking (done, matched), got {shown(on_batch)}"
        )
    matched = storage.run_bulk_count(runs, MAX_LIMIT if limit is None else limit)
    if dry_run or matched == 0:
        return BulkResult(matched=matched, changed=0, dry_run=dry_run)
    left = MAX_LIMIT if limit is None else limit
    changed = 0
    done = 0
    for status in runs.statuses:
        before: tuple[datetime, uuid.UUID] | None = None
        while left > 0:
            asked = min(BATCH_SIZE, left)
            batch = storage.run_bulk_batch(action, runs, status, before, asked)
            changed += batch.changed
            done += batch.visited
            left -= batch.visited
            if batch.visited and on_batch is not None:
                on_batch(done, max(matched, done))
            if batch.last is None or batch.visited < asked:
                break  # the walk of this status reached its end
            before = batch.last
    return BulkResult(matched=matched, changed=changed, dry_run=False)


def parse_filter_time(label: str, text: str, *, naive_is_utc: bool) -> datetime:
    """``text`` as a timezone-aware datetime, or a ConfigurationError naming ``label``.
    A time without an offset is UTC when ``naive_is_utc``, else refused. A space may stand
    for the ``T``."""
    value = text.strip()
    try:
        parsed = datetime.fromisoformat(value.replace(" ", "T", 1))
    except ValueError:
        how = "UTC unless it gives an offset" if naive_is_utc else "with its UTC offset"
        raise ConfigurationError(
            f"{label} must be a time like 2026-12-01T09:00:00+00:00 (ISO 8601, {how}), "
            f"got {shown(value, 40)}"
        ) from None
    if parsed.utcoffset() is not None:
        return parsed
    if naive_is_utc:
        return parsed.replace(tzinfo=UTC)
    raise ConfigurationError(
        f"{label} {shown(value, 40)} has no UTC offset: add one (e.g. +00:00 or Z)"
    )


def filter_time_text(value: datetime) -> str:
    """``value`` as the console writes a filter back (links, hidden fields): UTC without an
    offset, to the microsecond when it has a fraction (a bulk action's form must act on the
    runs its confirmation counted), or as given, with its offset, when its UTC instant is
    outside years 1 to 9999."""
    try:
        moment = value.astimezone(UTC)
    except OverflowError:
        return value.isoformat()
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%f" if moment.microsecond else "%Y-%m-%dT%H:%M:%S")


def filter_time_field(value: datetime) -> str:
    """``value`` for a ``datetime-local`` input with ``step=1`` (UTC, whole seconds); empty
    when its UTC instant is outside years 1 to 9999 (the links keep it)."""
    try:
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")
    except OverflowError:
        return ""
