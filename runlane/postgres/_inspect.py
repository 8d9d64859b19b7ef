"""The operator's repository of runs: the status counts, list runs, a run's history, retry
or cancel a run. Statements: ``sql/inspect.sql`` (the indexes that serve listing are
migration 4's), ``sql/status.sql``, ``sql/cancel.sql``.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from psycopg.rows import dict_row

from runlane._operator.runs import run_error
from runlane.models import (
    AttemptRecord,
    ResolvedTokenStatus,
    RunHistory,
    RunSnapshot,
    RunStatus,
    StepRecord,
)
from runlane.postgres._audit import audited
from runlane.postgres._connections import Conn
from runlane.postgres._executor import FIRST_PAGE, Executor
from runlane.postgres._queues import status_queues
from runlane.postgres._runs import snapshot
from runlane.storage import RetryOutcome, RunListQuery

__all__ = ["InspectRepository"]

# the unfiltered listing walks each status's part of runs_listing_by_status
_STATUSES = [status.value for status in RunStatus]


class InspectRepository:
    """What operators read of runs, and the single-run actions."""

    def __init__(self, db: Executor) -> None:
        self._db = db
        self._sql = db.sql

    def status_counts(self, environment: str) -> dict[str, Any]:
        params = {"environment": environment}

        def counts(conn: Conn) -> dict[str, Any]:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["status_counts"], params)
                row = cur.fetchone()
                assert row is not None
                cur.execute(self._sql["queue_list"], params)
                queues = status_queues(cur.fetchall())
                cur.execute(self._sql["status_resolved_tokens"], params)
                resolved = tuple(ResolvedTokenStatus(**token) for token in cur.fetchall())
            return {**row, "queues": queues, "resolved_tokens": resolved}

        return self._db.run(counts)

    def run_list_statement(self, query: RunListQuery) -> tuple[str, dict[str, Any]]:
        """The statement ``run_list`` executes for ``query``, and its parameters."""
        before_created_at: datetime | str
        before_created_at, before_id = FIRST_PAGE if query.before is None else query.before
        params: dict[str, Any] = {
            "environment": query.environment,
            "status": None if query.status is None else query.status.value,
            "task_id": query.task_id,
            "queue": query.queue,
            "limit": query.limit,
            "before_created_at": before_created_at,
            "before_id": before_id,
        }
        if query.status is None:
            params["statuses"] = _STATUSES
        return self._sql["run_list" if query.status is None else "run_list_by_status"], params

    def run_list(self, query: RunListQuery) -> list[RunSnapshot]:
        statement, params = self.run_list_statement(query)

        def listed(conn: Conn) -> list[RunSnapshot]:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(statement, params)
                return [snapshot(row) for row in cur.fetchall()]

        return self._db.run(listed)

    def run_history(self, environment: str, run_id: uuid.UUID) -> RunHistory | None:
        params = {"environment": environment, "id": run_id}

        def read(conn: Conn) -> RunHistory | None:
            with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["history_snapshot"])
                cur.execute(self._sql["run_get"], params)
                run = cur.fetchone()
                if run is None:
                    return None
                cur.execute(self._sql["run_attempt_list"], params)
                attempts = tuple(
                    AttemptRecord(
                        number=row["attempt"],
                        outcome=row["outcome"],
                        error=run_error(row["error"]),
                        started_at=row["started_at"],
                        finished_at=row["finished_at"],
                        worker_id=row["worker_id"],
                        host=row["host"],
                    )
                    for row in cur.fetchall()
                )
                cur.execute(self._sql["run_step_list"], params)
                steps = tuple(StepRecord(**row) for row in cur.fetchall())
            return RunHistory(run=snapshot(run), attempts=attempts, steps=steps)

        return self._db.run(read)

    def run_retry(self, environment: str, run_id: uuid.UUID) -> RetryOutcome:
        # run_retry is keyed by ids: retry_runs passes it a batch (see _bulk.py)
        statement, extra = audited(self._db, "run_retry")
        params: dict[str, Any] = {
            "environment": environment,
            "ids": [run_id],
            "skip_locked": False,
            **extra,
        }

        def retry(conn: Conn) -> RetryOutcome:
            # one transaction: the run read as the retry left it, before a worker can claim it
            with conn.transaction():
                row = conn.execute(self._sql[statement], params).fetchone()
                if row is None:
                    return RetryOutcome(previous=None, pruned=False, retried=False)
                _, status, pruned, retried = row
                run = None
                if retried:
                    with conn.cursor(row_factory=dict_row) as cur:
                        cur.execute(self._sql["run_get"], {"id": run_id, **params})
                        found = cur.fetchone()
                    run = None if found is None else snapshot(found)
            return RetryOutcome(
                previous=RunStatus(status), pruned=bool(pruned), retried=bool(retried), run=run
            )

        return self._db.run(retry)

    def run_cancel(self, environment: str, run_id: uuid.UUID) -> tuple[RunStatus, RunStatus] | None:
        # run_cancel is keyed by ids: cancel_runs passes it a batch (see _bulk.py)
        statement, extra = audited(self._db, "run_cancel")
        params = {"environment": environment, "ids": [run_id], "skip_locked": False, **extra}

        def cancel(conn: Conn) -> tuple[RunStatus, RunStatus] | None:
            row = conn.execute(self._sql[statement], params).fetchone()
            if row is None:
                return None
            _, before, after = row
            previous = RunStatus(before)
            return previous, RunStatus(after) if after is not None else previous

        return self._db.run(cancel)
