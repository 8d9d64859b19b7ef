"""The runs repository: triggering and point reads (``sql/runs.sql``, ``sql/group.sql``).

Concurrent lone calls share a statement (group commit, ``_group.py``); larger or keyed-by-
concurrency calls write in statements of their own; ``connection=`` writes on the caller's
connection; with a transport lane's publisher attached, calls without ``connection=`` take
the eager path (``_eager.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row, tuple_row

from runlane._operator.runs import run_error
from runlane.models import RunSnapshot, RunStatus
from runlane.postgres._batches import pipelined, refusing_too_large, split_runs
from runlane.postgres._connections import Conn
from runlane.postgres._eager import EagerInserts, EagerPublisher
from runlane.postgres._executor import Executor
from runlane.postgres._group import GroupCommit, group_row, group_rows, groupable
from runlane.postgres._inserts import created, group_handles, insert_params, resolved
from runlane.storage import InsertedRun, NewRuns

__all__ = ["RunRepository", "snapshot"]


class RunRepository:
    """Inserts (group commit for concurrent lone calls, a statement of their own for the
    rest, the caller's connection with ``connection=``) and point reads."""

    def __init__(self, db: Executor, publisher: EagerPublisher | None = None) -> None:
        self._db = db
        self.group = GroupCommit(self.insert_direct, self.insert_together)
        self.eager = None if publisher is None else EagerInserts(db, publisher)

    def attach(self, publisher: EagerPublisher) -> None:
        """Calls without ``connection=`` take the eager path from now on."""
        self.eager = EagerInserts(self._db, publisher)

    def run_insert_many(self, runs: NewRuns, *, connection: Any = None) -> list[InsertedRun]:
        if connection is not None:
            return self.insert_direct(runs, connection)
        shared = runs.concurrency_key is None and groupable(runs)
        if self.eager is not None:
            return self.eager.group.insert(runs) if shared else self.eager.insert(runs)
        return self.group.insert(runs) if shared else self.insert_direct(runs)

    def insert_together(
        self,
        groups: Sequence[NewRuns],
        rows: str | None = None,
        committed: Callable[[], None] | None = None,
    ) -> list[list[InsertedRun]]:
        """The runs of several trigger() calls in one statement and one commit (_group); each
        call's handles, in order. ``rows``: the calls' rows made already (group_rows);
        ``committed`` is called once the statement has committed."""
        params = {"rows": group_rows([group_row(r) for r in groups]) if rows is None else rows}
        keyed = any(key is not None for runs in groups for key in runs.idempotency_keys)
        find = self._db.sql["run_find_existing"]

        def insert(conn: Conn) -> list[list[InsertedRun]]:
            inserted: set[uuid.UUID] | None = None  # None: every run written by this statement
            if keyed:
                rows = self._db.raw["run_insert_group"].rows(conn, params)
                inserted = {uuid.UUID(row[0]) for row in rows if row[0] is not None}
            else:
                # without keys nothing can conflict: no conflict handling, no ids sent back
                try:
                    self._db.raw["run_insert_group_fresh"].rows(conn, params)
                except psycopg.errors.UniqueViolation:
                    # repeated after its first answer was lost: its runs are there
                    # (autocommit, so this failure undid nothing); read them back
                    inserted = set()
            if committed is not None:
                committed()
            return group_handles(conn, find, groups, inserted)

        return self._db.run(insert)

    def insert_one(self, runs: NewRuns) -> list[InsertedRun]:
        """One run on a pool connection (a lone trigger, a call of a failed group, a run too
        large to group): run_insert_one's statement through libpq (postgres/_pq.py), which
        costs less Python than a cursor."""
        keyed = runs.idempotency_keys[0] is not None
        params = insert_params(runs, one=True, keyed=keyed)
        find = self._db.sql["run_find_existing"]

        def insert(conn: Conn) -> list[InsertedRun]:
            if keyed:
                rows = self._db.raw["run_insert_one"].rows(conn, params)
                return resolved(conn, find, runs, {uuid.UUID(r[0]) for r in rows if r[0]})
            try:
                self._db.raw["run_insert_one_fresh"].rows(conn, params)
            except psycopg.errors.UniqueViolation:
                # retried after its first answer was lost: its run is there (autocommit, so
                # this failure undid nothing); read it back
                return resolved(conn, find, runs, set())
            return created(runs)

        return self._db.run(lambda conn: refusing_too_large(insert, conn, runs))

    def insert_direct(self, runs: NewRuns, connection: Any = None) -> list[InsertedRun]:
        """``runs`` in statements of their own (on the caller's connection, if given)."""
        pieces = split_runs(runs)
        if len(pieces) > 1:
            return self._insert_split(runs, pieces, connection)
        one = len(runs.ids) == 1
        if one and connection is None:
            return self.insert_one(runs)
        keyed = any(key is not None for key in runs.idempotency_keys)
        params = insert_params(runs, one=one, keyed=keyed)
        sql = self._db.sql
        if keyed:
            statement = sql["run_insert_one" if one else "run_insert_many"]
        else:
            # without keys nothing can conflict: no conflict handling, no ids sent back
            statement = sql["run_insert_one_fresh" if one else "run_insert_many_fresh"]

        def insert(conn: psycopg.Connection[Any]) -> list[InsertedRun]:
            with conn.cursor(row_factory=tuple_row) as cur:
                if not keyed:
                    try:
                        cur.execute(statement, params)
                    except psycopg.errors.UniqueViolation:
                        if connection is not None:
                            raise
                        # this statement was retried after its first answer was lost: the
                        # runs it wrote are there (autocommit, so this failure undid nothing)
                        return resolved(conn, sql["run_find_existing"], runs, set())
                    return created(runs)
                cur.execute(statement, params)
                inserted = {row[0] for row in cur.fetchall()}
            return resolved(conn, sql["run_find_existing"], runs, inserted)

        return self._on(insert, runs, connection)

    def _insert_split(
        self, runs: NewRuns, pieces: Sequence[NewRuns], connection: Any
    ) -> list[InsertedRun]:
        """A batch too large for one statement: one statement per piece, in one transaction
        and one round trip (see _batches); the statement for keys, whose conflict handling
        also covers a retry after a lost answer."""
        sql = self._db.sql

        def insert(conn: psycopg.Connection[Any]) -> list[InsertedRun]:
            params = [insert_params(piece) for piece in pieces]
            rows = pipelined(conn, sql["run_insert_many"], params)
            return resolved(conn, sql["run_find_existing"], runs, {row[0] for row in rows})

        return self._on(insert, runs, connection)

    def _on(
        self,
        insert: Callable[[psycopg.Connection[Any]], list[InsertedRun]],
        runs: NewRuns,
        connection: Any,
    ) -> list[InsertedRun]:
        """``insert`` on a pool connection, or on the caller's (``connection=``)."""
        if connection is None:
            return self._db.run(lambda conn: refusing_too_large(insert, conn, runs))
        return self._db.on_callers(connection, lambda conn: refusing_too_large(insert, conn, runs))

    # -- point reads -----------------------------------------------------------------------

    def run_get(self, environment: str, run_id: uuid.UUID) -> RunSnapshot | None:
        def get(conn: Conn) -> dict[str, Any] | None:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._db.sql["run_get"], {"id": run_id, "environment": environment})
                return cur.fetchone()

        row = self._db.run(get)
        return None if row is None else snapshot(row)

    def run_get_many(
        self, environment: str, run_ids: Sequence[uuid.UUID]
    ) -> dict[uuid.UUID, RunSnapshot]:
        params = {"ids": list(run_ids), "environment": environment}

        def get(conn: Conn) -> dict[uuid.UUID, RunSnapshot]:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._db.sql["run_get_many"], params)
                return {row["id"]: snapshot(row) for row in cur.fetchall()}

        return self._db.run(get)


def snapshot(row: dict[str, Any]) -> RunSnapshot:
    """A run as ``run_get``'s columns give it."""
    error = row["error"]
    return RunSnapshot(
        id=row["id"],
        environment=row["environment"],
        task_id=row["task_id"],
        queue=row["queue"],
        status=RunStatus(row["status"]),
        attempt=row["attempt"],
        attempts_spent=row["attempts_spent"],
        max_attempts=row["max_attempts"],
        priority=row["priority"],
        payload=row["payload"],
        output=row["output"],
        error=run_error(error),
        idempotency_key=row["idempotency_key"],
        parent_run_id=row["parent_run_id"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        due_at=row["due_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        progress=row.get("progress"),
        executing=bool(row.get("executing", False)),
    )
