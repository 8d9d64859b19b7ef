"""``Runlane.stats``: the per-minute rollup read in buckets (``runlane.stats``), its window
checked first."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, TypedDict

import attrs

from runlane._validation import as_moment, check_text
from runlane.errors import ConfigurationError
from runlane.runtime._backend import Opened
from runlane.stats import BUCKETS, Stats, StatsBucket
from runlane.tasks import Task
from runlane.toolkit import shown

__all__ = ["StatsOptions", "StatsReads"]

# buckets a window may hold (a week in minutes is 10,080)
MAX_BUCKETS = 10_080
# the default bucket is the smallest giving at most this many (1 h: 1m, 24 h: 15m, 7 d: 1h)
_DEFAULT_BUCKETS = 200
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class StatsOptions(TypedDict, total=False):
    """``Runlane.stats``' keywords."""

    queue: str | None
    task: str | Task[Any, Any] | None
    since: datetime | None
    until: datetime | None
    bucket: str | timedelta | None


def _moment(name: str, value: object) -> datetime | None:
    moment = as_moment(name, value)
    try:
        return None if moment is None else moment.astimezone(UTC)
    except OverflowError:
        raise ConfigurationError(f"{name} {shown(value)} is out of range") from None


def _bucket(value: object, window: timedelta) -> timedelta:
    names = ", ".join(BUCKETS)
    if value is None:
        return next((b for b in BUCKETS.values() if window / b <= _DEFAULT_BUCKETS), BUCKETS["1d"])
    if isinstance(value, str) and value in BUCKETS:
        return BUCKETS[value]
    if isinstance(value, timedelta) and value in BUCKETS.values():
        return value
    raise ConfigurationError(
        f"bucket must be one of {names} (or the timedelta of one), got {shown(value)}"
    )


def _name(bucket: timedelta) -> str:
    return next(name for name, size in BUCKETS.items() if size == bucket)


def _floor(moment: datetime, bucket: timedelta) -> datetime:
    return moment - (moment - _EPOCH) % bucket


@attrs.define(eq=False)
class StatsReads:
    """Reads of the rollup through the storage ``opened()`` returns, in one environment."""

    _environment: str
    _opened: Opened

    def read(self, options: StatsOptions) -> Stats:
        unknown = set(options) - set(StatsOptions.__annotations__)
        if unknown:
            raise ConfigurationError(
                f"stats() takes queue, task, since, until and bucket; not {sorted(unknown)}"
            )
        queue = options.get("queue")
        queue = None if queue is None else check_text("queue", queue)
        task = options.get("task")
        task_id = task.id if isinstance(task, Task) else task
        task_id = None if task_id is None else check_text("task", task_id)
        since = _moment("since", options.get("since"))
        until = _moment("until", options.get("until"))
        storage = self._opened()
        if until is None:
            until = storage.database_now().astimezone(UTC)
        if since is None:
            since = until - timedelta(hours=1)
        if since >= until:
            raise ConfigurationError(
                f"since ({since.isoformat()}) must be before until ({until.isoformat()})"
            )
        bucket = _bucket(options.get("bucket"), until - since)
        first = _floor(since, bucket)
        count = -((first - until) // bucket)  # buckets from first until past until
        if count > MAX_BUCKETS:
            raise ConfigurationError(
                f"the window from {since.isoformat()} to {until.isoformat()} holds {count} "
                f"buckets of {_name(bucket)}; at most {MAX_BUCKETS}: pick a larger bucket "
                "or a shorter window"
            )
        rows = storage.stats_read(
            self._environment,
            queue=queue,
            task_id=task_id,
            since=first,
            until=until,
            bucket=bucket,
        )
        found = {row.start: row for row in rows}
        buckets = tuple(
            found.get(start, StatsBucket(start=start))
            for start in (first + i * bucket for i in range(count))
        )
        return Stats(
            environment=self._environment,
            queue=queue,
            task=task_id,
            since=since,
            until=until,
            bucket=bucket,
            buckets=buckets,
        )
