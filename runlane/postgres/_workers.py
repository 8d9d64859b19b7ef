"""The workers repository: the operator's list of delivery workers and their cleanup. A
worker's own writes (its registration and heartbeat) ride in the lease extension
statement (``run_extend_leases``, ``_attempts.py``). The statements are in
``sql/workers.sql``.
"""

from __future__ import annotations

from datetime import timedelta

from psycopg.rows import dict_row

from runlane.models import WorkerInfo, WorkerState
from runlane.postgres._connections import Conn
from runlane.postgres._executor import Executor
from runlane.storage import MaintenanceFence

__all__ = ["WorkerRepository"]


class WorkerRepository:
    """Worker statements."""

    def __init__(self, db: Executor) -> None:
        self._db = db
        self._sql = db.sql

    def worker_list(self, environment: str, *, include_stopped: bool) -> list[WorkerInfo]:
        params = {"environment": environment, "include_stopped": include_stopped}

        def listed(conn: Conn) -> list[WorkerInfo]:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["worker_list"], params)
                return [
                    WorkerInfo(
                        worker_id=row["id"],
                        host=row["host"],
                        pid=row["pid"],
                        runlane_version=row["runlane_version"],
                        queues=tuple(row["queues"]),
                        concurrency=row["concurrency"],
                        started_at=row["started_at"],
                        last_seen_at=row["last_seen_at"],
                        state=WorkerState(row["state"]),
                        stopped_at=row["stopped_at"],
                    )
                    for row in cur.fetchall()
                ]

        return self._db.run(listed)

    def worker_prune(
        self,
        environment: str,
        retention: timedelta,
        limit: int,
        *,
        fence: MaintenanceFence | None = None,
    ) -> int:
        params = {
            "environment": environment,
            "retention_seconds": retention.total_seconds(),
            "limit": limit,
        }
        return self._db.fenced(
            fence, lambda conn: conn.execute(self._sql["worker_prune"], params).rowcount
        )
