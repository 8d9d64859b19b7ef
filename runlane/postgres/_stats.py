"""The stats repository: the per-minute rollup (migration 20) the maintenance band
``stats`` folds and prunes, and its read for ``Runlane.stats``. Statements:
``sql/stats.sql``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from runlane.postgres._connections import Conn
from runlane.postgres._executor import Executor
from runlane.stats import HISTOGRAM_BOUNDS, Histogram, StatsBucket
from runlane.storage import MaintenanceFence

__all__ = ["StatsRepository"]

_NEGATED_BOUNDS = [-bound for bound in reversed(HISTOGRAM_BOUNDS)]


def _histogram(pairs: list[list[int]], total: float) -> Histogram:
    counts = [0] * (len(HISTOGRAM_BOUNDS) + 1)
    for index, n in pairs:
        counts[index - 1] = n  # SQL arrays count from 1
    return Histogram(tuple(counts), float(total))


class StatsRepository:
    """Rollup statements."""

    def __init__(self, db: Executor) -> None:
        self._db = db
        self._sql = db.sql

    def stats_fold(
        self,
        environment: str,
        lookback: timedelta,
        max_minutes: int,
        *,
        fence: MaintenanceFence | None = None,
    ) -> int:
        params = {
            "environment": environment,
            "lookback_seconds": lookback.total_seconds(),
            "max_minutes": max_minutes,
            "bucket_count": len(HISTOGRAM_BOUNDS),
            "negated_bounds": _NEGATED_BOUNDS,
        }
        statement = self._sql["stats_fold"]

        def fold(conn: Conn) -> int:
            row = conn.execute(statement, params).fetchone()
            assert row is not None
            return int(row[2])

        return self._db.fenced(fence, fold)

    def stats_prune(
        self,
        environment: str,
        keep: timedelta,
        limit: int,
        *,
        fence: MaintenanceFence | None = None,
    ) -> int:
        params = {"environment": environment, "keep_seconds": keep.total_seconds(), "limit": limit}
        statement = self._sql["stats_prune"]
        return self._db.fenced(fence, lambda conn: conn.execute(statement, params).rowcount)

    def stats_read(
        self,
        environment: str,
        *,
        queue: str | None,
        task_id: str | None,
        since: datetime,
        until: datetime,
        bucket: timedelta,
    ) -> list[StatsBucket]:
        params: dict[str, Any] = {
            "environment": environment,
            "queue": queue,
            "task_id": task_id,
            "since": since,
            "until": until,
            "bucket_seconds": bucket.total_seconds(),
        }
        statement = self._sql["stats_read"]

        def read(conn: Conn) -> list[StatsBucket]:
            return [
                StatsBucket(
                    start=row[0],
                    triggered=int(row[1]),
                    started=int(row[2]),
                    retried=int(row[3]),
                    completed=int(row[4]),
                    failed=int(row[5]),
                    cancelled=int(row[6]),
                    wait=_histogram(row[9], row[7]),
                    run_time=_histogram(row[10], row[8]),
                )
                for row in conn.execute(statement, params).fetchall()
            ]

        return self._db.run(read)
