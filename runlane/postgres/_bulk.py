"""The bulk repository: the operator's actions by filter (retry, cancel, delete) and their
counts. Statements: ``sql/bulk.sql``.

A batch is two statements in one transaction: ``run_bulk_pick`` picks the batch, then the
single-run action's own statement, keyed by ids, locks what no one else holds and changes
it (``run_retry`` of retry_run, ``run_cancel`` of cancel, ``run_prune_ids`` of cleanup:
migration 14's SECURITY DEFINER functions), so each transition is written once.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import psycopg

from runlane.models import RunStatus
from runlane.postgres._audit import audited
from runlane.postgres._connections import Conn, own_transaction
from runlane.postgres._executor import FIRST_PAGE, Executor
from runlane.postgres._maintenance import prune_ids
from runlane.storage import BulkBatch, BulkFilter

__all__ = ["BulkRepository", "RequeueCount"]

# A bulk retry analyses runs once it has moved this many runs into queued in one walk, then
# each time the walk's count grows tenfold (10,000, 100,000, 1,000,000: three ANALYZEs of
# one to two seconds for a million). The first is what matters: from then on the planner
# knows queued runs are many and claims read runs_claimable (sql/bulk.sql runs_analyze).
ANALYZE_AFTER = 10_000


def _filter_params(runs: BulkFilter) -> dict[str, Any]:
    return {
        "environment": runs.environment,
        "task_id": runs.task_id,
        "queue": runs.queue,
        "created_after": runs.created_after,
        "created_before": runs.created_before,
        "run_ids": None if runs.run_ids is None else list(runs.run_ids),
    }


class RequeueCount:
    """Runs moved into queued by the current retry walk, and the count that analyses next:
    kept across its batches, also when each runs on a view of the storage (an audited
    batch, postgres/_audit.py)."""

    def __init__(self) -> None:
        self.counts: tuple[int, int] = (0, ANALYZE_AFTER)


class BulkRepository:
    """Counts and batches of the bulk actions."""

    def __init__(self, db: Executor, requeued: RequeueCount | None = None) -> None:
        self._db = db
        self._sql = db.sql
        self._requeued = requeued or RequeueCount()

    def run_bulk_count(self, runs: BulkFilter, limit: int) -> int:
        params = {
            **_filter_params(runs),
            "statuses": [status.value for status in runs.statuses],
            "limit": limit,
        }

        def count(conn: Conn) -> int:
            row = conn.execute(self._sql["run_bulk_count"], params).fetchone()
            return 0 if row is None else int(row[0])

        return self._db.run(count)

    def run_bulk_count_within(
        self, runs: BulkFilter, limit: int, seconds: float
    ) -> tuple[int, bool]:
        params = {
            **_filter_params(runs),
            "statuses": [status.value for status in runs.statuses],
            "limit": limit,
        }

        def count(conn: Conn) -> tuple[int, bool]:
            try:
                with conn.transaction():
                    conn.execute(
                        "select set_config('statement_timeout', %s, true)",
                        (f"{max(1, round(seconds * 1000))}ms",),
                    )
                    row = conn.execute(self._sql["run_bulk_count"], params).fetchone()
                return (0 if row is None else int(row[0])), True
            except psycopg.errors.QueryCanceled:
                pass
            # the count's own plan, without its bound: the Limit node's row estimate
            unbounded = {**params, "limit": None}
            row = conn.execute(
                "explain (format json) " + self._sql["run_bulk_count"], unbounded
            ).fetchone()
            assert row is not None
            (limited,) = row[0][0]["Plan"]["Plans"]
            return int(limited["Plan Rows"]), False

        return self._db.run(count)

    def run_bulk_batch(
        self,
        action: str,
        runs: BulkFilter,
        status: RunStatus,
        before: tuple[datetime, uuid.UUID] | None,
        size: int,
    ) -> BulkBatch:
        before_created_at, before_id = FIRST_PAGE if before is None else before
        params = {
            **_filter_params(runs),
            "status": status.value,
            "before_created_at": before_created_at,
            "before_id": before_id,
            "batch": size,
        }
        act = {"retry": self._retry_ids, "cancel": self._cancel_ids, "delete": self._delete_ids}[
            action
        ]

        def batch(conn: Conn) -> BulkBatch:
            # the batch is its own transaction: the action's row locks hold until it commits
            with own_transaction(conn):
                picked = conn.execute(self._sql["run_bulk_pick"], params).fetchall()
                changed = act(conn, runs.environment, [row[0] for row in picked])
            # newest first: the last row picked is the cursor of the next batch
            last = None if not picked else (picked[-1][1], picked[-1][0])
            return BulkBatch(visited=len(picked), changed=changed, last=last)

        done = self._db.run(batch)
        if action == "retry":
            self._count_requeued(first=before is None, changed=done.changed)
        return done

    def _count_requeued(self, *, first: bool, changed: int) -> None:
        """Analyse runs when this retry walk's count of runs moved into queued reaches the
        next threshold (ANALYZE_AFTER, then tenfold)."""
        moved, threshold = (0, ANALYZE_AFTER) if first else self._requeued.counts
        moved += changed
        if moved >= threshold:
            self._db.run(lambda conn: conn.execute(self._sql["runs_analyze"]))
            threshold = max(threshold, moved) * 10
        self._requeued.counts = (moved, threshold)

    def _retry_ids(self, conn: Conn, environment: str, ids: list[uuid.UUID]) -> int:
        """retry_run's run_retry on the picked runs no one holds; how many were retried."""
        if not ids:
            return 0
        statement, extra = audited(self._db, "run_retry")
        params = {"environment": environment, "ids": ids, "skip_locked": True, **extra}
        rows = conn.execute(self._sql[statement], params)
        return sum(1 for _, _, _, retried in rows if retried)

    def _cancel_ids(self, conn: Conn, environment: str, ids: list[uuid.UUID]) -> int:
        """cancel's run_cancel on the picked runs no one holds; how many were cancelled or
        asked to stop."""
        if not ids:
            return 0
        statement, extra = audited(self._db, "run_cancel")
        params = {"environment": environment, "ids": ids, "skip_locked": True, **extra}
        rows = conn.execute(self._sql[statement], params)
        return sum(1 for _, _, current in rows if current is not None)

    def _delete_ids(self, conn: Conn, environment: str, ids: list[uuid.UUID]) -> int:
        """Cleanup's run_prune_ids on the picked runs no one holds; how many were deleted or
        tombstoned (inside an audited action, ``run_prune_ids_audited``: the overload naming
        the action)."""
        statement, extra = audited(self._db, "run_prune_ids")
        sql = self._sql[statement]
        return sum(prune_ids(conn, sql, environment, ids, skip_locked=True, extra=extra))
