"""The web repository: the console's reads (:mod:`runlane.web`): throughput over the last
hour, a run's wait, trace context and children, and the estimated size of runs. The
statements are in ``sql/web.sql``; each is served by an index (or the catalog) whatever the
table's size.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from runlane.models import RunSnapshot, RunStatus
from runlane.postgres._connections import Conn
from runlane.postgres._executor import FIRST_PAGE, Executor
from runlane.postgres._runs import snapshot
from runlane.storage import RunListQuery, RunSearchResult

__all__ = ["FIRST_WINDOW", "SEARCH_WINDOW", "WebReadRepository"]

SEARCH_WINDOW = 2000  # runs one window of a search walks at most (newest first)
FIRST_WINDOW = 250  # ... the first: a common match fills its page at once; each next is 4x
_STATUSES = [status.value for status in RunStatus]


class WebReadRepository:
    """Console reads."""

    def __init__(self, db: Executor) -> None:
        self._db = db
        self._sql = db.sql

    def web_run_extras(
        self, environment: str, run_id: uuid.UUID, children_limit: int
    ) -> dict[str, Any] | None:
        params = {"environment": environment, "id": run_id, "limit": children_limit}

        def read(conn: Conn) -> dict[str, Any] | None:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["web_run_extras"], params)
                row = cur.fetchone()
                if row is None:
                    return None
                cur.execute(self._sql["web_run_children"], params)
                return {**row, "children": cur.fetchall()}

        return self._db.run(read)

    def web_runs_estimate(self) -> int:
        def read(conn: Conn) -> int:
            row = conn.execute(self._sql["web_runs_estimate"]).fetchone()
            return 0 if row is None else int(row[0])

        return self._db.run(read)

    def web_run_search(self, query: RunListQuery, seconds: float) -> RunSearchResult:
        before: tuple[Any, uuid.UUID] = FIRST_PAGE if query.before is None else query.before
        params: dict[str, Any] = {
            "environment": query.environment,
            "statuses": _STATUSES if query.status is None else [query.status.value],
            "task_id": query.task_id,
            "queue": query.queue,
            "task_prefix": query.task_prefix,
            "queue_prefix": query.queue_prefix,
            "idempotency_key": query.idempotency_key,
            "payload": None if query.payload_contains is None else Jsonb(query.payload_contains),
            "before_created_at": before[0],
            "before_id": before[1],
        }
        budget = timedelta(seconds=seconds)

        def search(conn: Conn) -> RunSearchResult:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute("select clock_timestamp() as clock")
                start = _clock(cur.fetchone())
                statement = self.indexed_statement(cur, query)
            if statement is not None:
                found = self.direct(conn, statement, {**params, "limit": query.limit}, budget)
                if found is not None:
                    return RunSearchResult(found, None, False)
            return self.windows(conn, params, query.limit, start, budget)

        return self._db.run(search)

    def indexed_statement(self, cur: Any, query: RunListQuery) -> str | None:
        """The statement that searches through an optional index this schema has for the
        query's payload or key filter (docs/console.md), None without one."""
        if query.payload_contains is None and query.idempotency_key is None:
            return None
        cur.execute(self._sql["web_search_indexes"])
        has = cur.fetchone()
        if query.payload_contains is not None and has["payload"]:
            return "web_run_search_by_payload"
        if query.idempotency_key is not None and has["key"]:
            return "web_run_search_by_key"
        return None

    def direct(
        self, conn: Conn, statement: str, params: dict[str, Any], budget: timedelta
    ) -> list[RunSnapshot] | None:
        """The matches through an index, in one statement within ``budget``; None when it
        ran out (a filter the index matches for too many runs): the windows go on."""
        try:
            with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
                _statement_timeout(cur, budget)
                cur.execute(self._sql[statement], params)
                return [snapshot(row) for row in cur.fetchall()]
        except psycopg.errors.QueryCanceled:
            return None

    def windows(
        self,
        conn: Conn,
        params: dict[str, Any],
        limit: int,
        start: datetime,
        budget: timedelta,
    ) -> RunSearchResult:
        """Walk runs newest first in windows (``FIRST_WINDOW``, then four times as many each
        time, up to ``SEARCH_WINDOW``) until ``limit`` matches, the oldest run, or the end of
        ``budget`` (counted from ``start``, database time)."""
        found: list[RunSnapshot] = []
        position = (params["before_created_at"], params["before_id"])
        walked_any = False
        window = FIRST_WINDOW
        try:
            with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
                cur.execute("select clock_timestamp() as clock")
                left = budget - (_clock(cur.fetchone()) - start)
                while True:
                    # the first window always runs (a search makes progress however small
                    # its budget); later ones only within what is left of it
                    _statement_timeout(cur, left if walked_any else timedelta(seconds=10))
                    cur.execute(
                        self._sql["web_run_search"],
                        {
                            **params,
                            "window": window,
                            "before_created_at": position[0],
                            "before_id": position[1],
                        },
                    )
                    rows = cur.fetchall()
                    walked_any = True
                    found += [snapshot(row) for row in rows if row["matched"]]
                    if len(found) >= limit:
                        return RunSearchResult(found[:limit], None, False)
                    if not rows or rows[-1]["walked"] < window:
                        return RunSearchResult(found, None, False)  # walked to the oldest
                    last = rows[-1]
                    position = (last["walked_created_at"], last["walked_id"])
                    window = min(SEARCH_WINDOW, window * 4)
                    left = budget - (last["clock"] - start)
                    if left <= timedelta(0):
                        return RunSearchResult(found, position, True)
        except psycopg.errors.QueryCanceled:
            # a later window ran out of the budget: what the earlier ones found stands
            return RunSearchResult(found, position, True)

    def web_worker_runs(
        self, environment: str, worker_ids: Sequence[str], limit: int
    ) -> dict[str, list[dict[str, Any]]]:
        params = {"environment": environment, "worker_ids": list(worker_ids), "limit": limit}

        def read(conn: Conn) -> dict[str, list[dict[str, Any]]]:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["web_worker_runs"], params)
                rows = cur.fetchall()
            held: dict[str, list[dict[str, Any]]] = {key: [] for key in worker_ids}
            for row in rows:
                held.setdefault(row["worker_id"], []).append(row)
            return held

        return self._db.run(read)


def _statement_timeout(cur: Any, allowed: timedelta) -> None:
    """The transaction's statements may take ``allowed`` (at least a millisecond)."""
    cur.execute(
        "select set_config('statement_timeout', %s, true)",
        (f"{max(1, round(allowed.total_seconds() * 1000))}ms",),
    )


def _clock(row: dict[str, Any] | None) -> datetime:
    assert row is not None
    return row["clock"]  # type: ignore[no-any-return]
