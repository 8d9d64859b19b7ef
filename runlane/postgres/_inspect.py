"""The Postgres storage's inspection and operator statements: list runs, a run's history,
retry a run. Mixed into :class:`~runlane.postgres.PostgresStorage`; the statements are in
``sql/inspect.sql`` and the indexes that serve listing in migration 4.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from psycopg.rows import dict_row

from runlane._operator.runs import run_error
from runlane.models import AttemptRecord, RunHistory, RunSnapshot, RunStatus, StepRecord
from runlane.postgres._connections import Conn
from runlane.storage import RetryOutcome, RunListQuery

__all__ = ["InspectMethods"]

T = TypeVar("T")

# the first page starts below every run: no created_at reaches infinity
_FIRST_PAGE_ID = uuid.UUID(int=2**128 - 1)
# the unfiltered listing walks each status's part of runs_listing_by_status
_STATUSES = [status.value for status in RunStatus]


class InspectMethods:
    """Inspection statements; expects the attributes PostgresStorage has."""

    _sql: dict[str, str]

    def _with_conn(self, fn: Callable[[Conn], T]) -> T:
        raise NotImplementedError

    def _snapshot_row(self, row: dict[str, Any]) -> RunSnapshot:
        raise NotImplementedError

    def run_list_statement(self, query: RunListQuery) -> tuple[str, dict[str, Any]]:
        """The statement ``run_list`` executes for ``query``, and its parameters."""
        before_created_at: datetime | str
        if query.before is None:
            before_created_at, before_id = "infinity", _FIRST_PAGE_ID
        else:
            before_created_at, before_id = query.before
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
                return [self._snapshot_row(row) for row in cur.fetchall()]

        return self._with_conn(listed)

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
            return RunHistory(run=self._snapshot_row(run), attempts=attempts, steps=steps)

        return self._with_conn(read)

    def run_retry(self, environment: str, run_id: uuid.UUID) -> RetryOutcome:
        # run_retry is keyed by ids: retry_runs passes it a batch (see _bulk.py)
        params: dict[str, Any] = {"environment": environment, "ids": [run_id], "skip_locked": False}

        def retry(conn: Conn) -> RetryOutcome:
            # one transaction: the run read as the retry left it, before a worker can claim it
            with conn.transaction():
                row = conn.execute(self._sql["run_retry"], params).fetchone()
                if row is None:
                    return RetryOutcome(previous=None, pruned=False, retried=False)
                _, status, pruned, retried = row
                run = None
                if retried:
                    with conn.cursor(row_factory=dict_row) as cur:
                        cur.execute(self._sql["run_get"], {"id": run_id, **params})
                        found = cur.fetchone()
                    run = None if found is None else self._snapshot_row(found)
            return RetryOutcome(
                previous=RunStatus(status), pruned=bool(pruned), retried=bool(retried), run=run
            )

        return self._with_conn(retry)
