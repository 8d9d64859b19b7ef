"""The stats repository: the rollup (migration 20) the maintenance band ``stats`` folds
and prunes, and its read for ``Runlane.stats``. Statements: ``sql/stats.sql``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from runlane.postgres._connections import Conn, own_transaction
from runlane.postgres._executor import Executor
from runlane.stats import HISTOGRAM_BOUNDS, Histogram, StatsBucket
from runlane.storage import MaintenanceFence

__all__ = ["StatsRepository"]

_NEGATED_BOUNDS = [-bound for bound in reversed(HISTOGRAM_BOUNDS)]
# the longer spans the minutes are summed into (stats_rollup.span), longest first
SPANS = (60, 15)


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
        window = {
            "environment": environment,
            "first": lookback // timedelta(minutes=1),
            "max_minutes": max_minutes,
        }
        sql = self._sql

        def fold(conn: Conn) -> int:
            with own_transaction(conn):  # the minutes, their spans and the mark together
                found = conn.execute(sql["stats_fold_window"], window).fetchone()
                if found is None:  # no minute closed since the last fold
                    return 0
                minutes = {"environment": environment, "start_at": found[0], "end_at": found[1]}
                histograms = {
                    "bucket_count": len(HISTOGRAM_BOUNDS),
                    "negated_bounds": _NEGATED_BOUNDS,
                }
                row = conn.execute(sql["stats_fold"], {**minutes, **histograms}).fetchone()
                assert row is not None
                for span in SPANS:
                    conn.execute(sql["stats_fold_span"], {**minutes, "span": span})
            return int(row[0])

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
            # the longest span that divides the bucket: the fewest rows to sum
            "span": next((s for s in SPANS if bucket % timedelta(minutes=s) == timedelta(0)), 1),
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
                    wait=Histogram(tuple(row[9]), float(row[7])),
                    run_time=Histogram(tuple(row[10]), float(row[8])),
                )
                for row in conn.execute(statement, params).fetchall()
            ]

        return self._db.run(read)
