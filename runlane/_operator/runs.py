"""Listing runs, their history and retrying them: argument checks, cursors and records.

The runtime's ``list_runs``, ``get_run_history`` and ``retry_run`` check their arguments
here, and storages convert their rows with the helpers below. A cursor is opaque to callers:
the ``(created_at, id)`` of the last run of a page, which the next page starts below
(keyset pagination), encoded as URL-safe base64 behind a version prefix.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, TypedDict

from runlane._codec import dump_json
from runlane._validation import check_text
from runlane.errors import ConfigurationError, RunStateConflict
from runlane.models import RunError, RunPage, RunSnapshot, RunStatus
from runlane.storage import RunListQuery, RunSearchResult
from runlane.toolkit import as_int, shown

__all__ = [
    "MAX_PAGE",
    "MAX_SEARCH_SECONDS",
    "RunSearch",
    "decode_cursor",
    "encode_cursor",
    "encode_position",
    "list_query",
    "optional_name",
    "retry_conflict",
    "run_error",
    "run_page",
    "search_page",
    "search_seconds",
]

MAX_PAGE = 1000
MAX_SEARCH_SECONDS = 60.0  # the longest time budget a search may be given
_MAX_PAYLOAD_FILTER_CHARS = 10_000
_CURSOR_PREFIX = "r1."
# what encode_cursor makes is about 110 characters; a longer one was not made by it, and is
# refused before decoding (a crafted one nesting 100,000 brackets would hit the recursion
# limit of json.loads)
_MAX_CURSOR_CHARS = 200


class RunSearch(TypedDict, total=False):
    """The search keywords ``list_runs`` takes besides its filters, every one optional:
    ``task_prefix`` and ``queue_prefix`` (the task id or queue name starts with it),
    ``idempotency_key`` (the key a run was triggered with, any task),
    ``payload_contains`` (a JSON object the payload contains, as jsonb ``@>`` reads it) and
    ``search_seconds`` (the search's budget of database time, 1 s by default)."""

    task_prefix: str | None
    queue_prefix: str | None
    idempotency_key: str | None
    payload_contains: Mapping[str, Any] | None
    search_seconds: float


def encode_cursor(run: RunSnapshot) -> str:
    """The cursor of the page that follows ``run`` (older runs)."""
    return encode_position(run.created_at, run.id)


def encode_position(created_at: datetime, run_id: uuid.UUID) -> str:
    """The cursor of the page that follows the run created at ``created_at`` with id
    ``run_id`` (older runs)."""
    text = json.dumps([created_at.isoformat(), str(run_id)], separators=(",", ":"))
    return _CURSOR_PREFIX + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_cursor(cursor: object) -> tuple[datetime, uuid.UUID]:
    """``(created_at, id)`` of a cursor made by ``encode_cursor``, or a ConfigurationError."""
    problem = (
        f"cursor {shown(cursor)} is not a runs cursor: pass the next_cursor of a RunPage (or "
        "the one `runlane runs list` printed), unchanged"
    )
    if (
        not isinstance(cursor, str)
        or not cursor.startswith(_CURSOR_PREFIX)
        or len(cursor) > _MAX_CURSOR_CHARS
    ):
        raise ConfigurationError(problem)
    body = cursor[len(_CURSOR_PREFIX) :]
    try:
        decoded = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        created, run_id = json.loads(decoded)
        created_at = datetime.fromisoformat(created)
        key = uuid.UUID(run_id)
    except (binascii.Error, ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise ConfigurationError(problem) from exc
    if created_at.utcoffset() is None:
        raise ConfigurationError(problem)
    return created_at, key


def _status(value: object) -> RunStatus | None:
    if value is None or isinstance(value, RunStatus):
        return value
    valid = ", ".join(s.value for s in RunStatus)
    if isinstance(value, str):
        try:
            return RunStatus(value)
        except ValueError:
            pass
    raise ConfigurationError(f"status {shown(value)} is not a run status; use one of: {valid}")


def optional_name(what: str, value: object) -> str | None:
    """A task id or queue name filter: None, or a non-empty string Postgres text holds."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{what} must be a non-empty string (or None), got {shown(value)}")
    return check_text(what, value)


def _payload_filter(value: object) -> object:
    """A payload containment filter: None, or a JSON object (a dict JSON can hold)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"payload_contains must be a JSON object (a dict) the payloads must contain, got "
            f"{shown(value)}"
        )
    try:
        # as a payload is checked: what Postgres jsonb refuses (NUL, lone surrogates) too
        text = dump_json(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConfigurationError(
            f"payload_contains must be JSON (str keys; str, number, bool, None, list and "
            f"dict values): {exc}"
        ) from exc
    if len(text) > _MAX_PAYLOAD_FILTER_CHARS:
        raise ConfigurationError(
            f"payload_contains is {len(text):,} characters of JSON; at most "
            f"{_MAX_PAYLOAD_FILTER_CHARS:,}"
        )
    return json.loads(text)


def search_seconds(value: object) -> float:
    """A search's time budget in seconds: a number above 0, at most MAX_SEARCH_SECONDS."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= MAX_SEARCH_SECONDS
    ):
        raise ConfigurationError(
            f"search_seconds must be a number of seconds above 0 and at most "
            f"{MAX_SEARCH_SECONDS:g}, got {shown(value)}"
        )
    return float(value)


def list_query(
    environment: str,
    *,
    status: object,
    task: object,
    queue: object,
    limit: object,
    cursor: object,
    task_prefix: object = None,
    queue_prefix: object = None,
    idempotency_key: object = None,
    payload_contains: object = None,
) -> RunListQuery:
    """Check ``list_runs``'s arguments; the query asks for one run more than the page, to
    know whether another page follows. ``task`` may be a Task (its id is used)."""
    page = as_int("limit", limit, 1, MAX_PAGE, hint="; page through more runs with next_cursor")
    task_id = getattr(task, "id", task) if not isinstance(task, str) else task
    return RunListQuery(
        environment=environment,
        status=_status(status),
        task_id=optional_name("task", task_id),
        queue=optional_name("queue", queue),
        limit=page + 1,
        before=None if cursor is None else decode_cursor(cursor),
        task_prefix=optional_name("task_prefix", task_prefix),
        queue_prefix=optional_name("queue_prefix", queue_prefix),
        idempotency_key=optional_name("idempotency_key", idempotency_key),
        payload_contains=_payload_filter(payload_contains),
    )


def run_page(rows: Sequence[RunSnapshot], limit: int) -> RunPage:
    """A page of ``limit`` runs out of ``limit + 1`` rows read (the extra one says another
    page follows)."""
    runs = tuple(rows[:limit])
    more = len(rows) > limit and bool(runs)
    return RunPage(runs=runs, next_cursor=encode_cursor(runs[-1]) if more else None)


def search_page(found: RunSearchResult, limit: int) -> RunPage:
    """A page of ``limit`` runs out of what a search found (it looked for ``limit + 1``).
    A search that ran out of its time budget gives what it found, ``searched_to`` (how far
    back it looked) and a cursor that continues from where it stopped."""
    if found.out_of_time and found.stopped_at is not None and len(found.runs) <= limit:
        created_at, run_id = found.stopped_at
        return RunPage(
            runs=tuple(found.runs),
            next_cursor=encode_position(created_at, run_id),
            searched_to=created_at,
        )
    return run_page(found.runs, limit)


def run_error(stored: object) -> RunError | None:
    """The RunError stored as JSON on a run or an attempt. runlane writes an object with
    a type and a message; a value written otherwise (through SQL, by a role that may write
    errors) is read as far as it goes rather than failing every read of its run."""
    if stored is None:
        return None
    if not isinstance(stored, Mapping):
        return RunError(type="unknown", message=json.dumps(stored))
    traceback = stored.get("traceback")
    return RunError(
        type=str(stored.get("type", "unknown")),
        message=str(stored.get("message", "")),
        traceback=traceback if isinstance(traceback, str) else None,
        retryable=stored.get("retryable", True) is not False,
    )


_RETRY_ADVICE = {
    RunStatus.QUEUED: "it is already waiting for a worker; nothing to retry",
    RunStatus.RETRYING: "it is already scheduled for its next attempt; nothing to retry",
    RunStatus.RELEASED: "it was handed back and will run again; nothing to retry",
    RunStatus.WAITING: (
        "it is suspended on a token, a child run or a sleep and resumes by itself; cancel it "
        "first if it should start over"
    ),
    RunStatus.RUNNING: (
        "an attempt is executing it; wait for it to end, or cancel it first and retry it "
        "once it is cancelled"
    ),
    RunStatus.CANCELLATION_REQUESTED: (
        "its cancellation is under way; wait until it is cancelled, then retry it"
    ),
    RunStatus.COMPLETED: "it completed; trigger a new run to execute the task again",
}


def retry_conflict(
    run_id: uuid.UUID, environment: str, status: RunStatus, pruned: bool
) -> RunStateConflict:
    """Why ``retry_run`` refused a run, and what to do instead."""
    if pruned:
        return RunStateConflict(
            f"run {run_id} in environment {environment!r} was pruned by cleanup (only its "
            "record as a parent is left): trigger a new run instead"
        )
    advice = _RETRY_ADVICE.get(status, "only failed or cancelled runs can be retried")
    return RunStateConflict(
        f"cannot retry run {run_id}: it is {status.value}, and only failed or cancelled runs "
        f"can be retried; {advice}"
    )
