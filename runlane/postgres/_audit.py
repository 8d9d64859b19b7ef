"""The audit trail's repository: an operator action and its record in one transaction,
the listing, retention, and reschedule. Statements: ``sql/audit.sql``; the table and the
SECURITY DEFINER functions are migration 21's.

An action's record commits with it or not at all: ``audit_action`` opens a transaction on
one connection and hands the action a view of the storage whose repositories run on that
connection (``_InTransaction``), so the action's own statements (``run_cancel``,
``queue_pause``, one bulk batch, ...) are the ones it always runs, and the record is
inserted after them, before the commit. A statement retried after its connection broke
repeats the whole transaction (the actions are safe to repeat; the record's id makes a
second insert of a committed record a no-op).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from runlane.models import AuditRecord, RunStatus
from runlane.postgres._connections import Conn
from runlane.postgres._executor import FIRST_PAGE, Executor
from runlane.storage import AuditEntry, MaintenanceFence, Rescheduled, Storage

__all__ = ["AuditRepository", "audited"]

T = TypeVar("T")


class _InTransaction(Executor):
    """An executor bound to one connection inside a transaction its creator holds: each
    ``run`` is a step of that transaction (the creator's ``run`` retries and translates
    errors for the whole of it), which writes the audit record of ``action``."""

    def __init__(self, db: Executor, conn: Conn, action: str) -> None:  # a view: no source
        self.schema, self.conninfo, self.sql, self.raw = db.schema, db.conninfo, db.sql, db.raw
        self.connect_timeout, self.statement_timeout = db.connect_timeout, None
        self._conn = conn
        self.action = action

    def run(self, fn: Callable[[Conn], T], *, draining: bool = False) -> T:
        return fn(self._conn)

    def fenced(self, fence: MaintenanceFence | None, fn: Callable[[Conn], T]) -> T:
        if fence is not None:
            raise AssertionError("an operator action takes no maintenance fence")
        return fn(self._conn)


def audited(db: Executor, statement: str) -> tuple[str, dict[str, str]]:
    """The name of ``statement`` to run on ``db``, and its extra parameters: inside an
    audited action's transaction, its ``_audited`` twin, which calls the function's
    overload naming the action (migration 24: it commits only with the action's record);
    else the statement itself (the functions of migrations 14 and 21, which the operator
    role may no longer call)."""
    if isinstance(db, _InTransaction):
        return f"{statement}_audited", {"action": db.action}
    return statement, {}


def _params(entry: AuditEntry, runs: int | None, changed: bool) -> dict[str, Any]:
    return {
        "id": entry.id,
        "action_id": entry.action_id,
        "part": entry.part,
        "environment": entry.environment,
        "via": entry.via,
        "actor": entry.actor,
        "os_user": entry.os_user,
        "action": entry.action,
        "target": entry.target,
        "runs": runs,
        "changed": changed,
        "reason": entry.reason,
        "details": Jsonb(entry.details),
    }


class AuditRepository:
    """The audit trail and reschedule; ``view(executor)`` makes the storage an action runs
    on inside the record's transaction."""

    def __init__(self, db: Executor, view: Callable[[Executor], Storage]) -> None:
        self._db = db
        self._sql = db.sql
        self._view = view

    def audit_action(
        self,
        entry: AuditEntry,
        action: Callable[[Storage], T],
        counted: Callable[[T], tuple[int | None, bool] | None],
    ) -> T:
        def both(conn: Conn) -> T:
            with conn.transaction():
                result = action(self._view(_InTransaction(self._db, conn, entry.action)))
                outcome = counted(result)
                if outcome is not None:
                    conn.execute(self._sql["audit_insert"], _params(entry, *outcome))
            return result

        return self._db.run(both)

    def audit_write(self, entry: AuditEntry, runs: int | None, changed: bool) -> None:
        self._db.run(
            lambda conn: conn.execute(self._sql["audit_insert"], _params(entry, runs, changed))
        )

    def audit_list(
        self,
        environment: str,
        since: datetime | None,
        before: tuple[datetime, uuid.UUID] | None,
        limit: int,
    ) -> list[AuditRecord]:
        before_at: datetime | str
        before_at, before_id = FIRST_PAGE if before is None else before
        params = {
            "environment": environment,
            "since": since,
            "before_at": before_at,
            "before_id": before_id,
            "limit": limit,
        }

        def listed(conn: Conn) -> list[AuditRecord]:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["audit_list"], params)
                return [
                    AuditRecord(
                        id=row["id"],
                        at=row["at"],
                        via=row["via"],
                        actor=row["actor"],
                        db_role=row["db_role"],
                        os_user=row["os_user"],
                        action=row["action"],
                        target=row["target"],
                        runs=None if row["runs"] is None else int(row["runs"]),
                        changed=bool(row["changed"]),
                        reason=row["reason"],
                        details=dict(row["details"] or {}),
                    )
                    for row in cur.fetchall()
                ]

        return self._db.run(listed)

    def audit_prune(
        self,
        environment: str,
        keep_seconds: float,
        limit: int,
        *,
        fence: MaintenanceFence | None = None,
    ) -> int:
        params = {"environment": environment, "keep_seconds": keep_seconds, "limit": limit}

        def prune(conn: Conn) -> int:
            row = conn.execute(self._sql["audit_prune"], params).fetchone()
            return 0 if row is None else int(row[0])

        return self._db.fenced(fence, prune)

    def run_reschedule(
        self, environment: str, run_id: uuid.UUID, run_at: datetime | None
    ) -> Rescheduled | None:
        statement, extra = audited(self._db, "run_reschedule")
        params = {"environment": environment, "ids": [run_id], "run_at": run_at, **extra}

        def reschedule(conn: Conn) -> Rescheduled | None:
            row = conn.execute(self._sql[statement], params).fetchone()
            if row is None:
                return None
            _, status, moved = row
            return Rescheduled(previous=RunStatus(status), moved=bool(moved))

        return self._db.run(reschedule)

    def run_delete(self, environment: str, run_id: uuid.UUID) -> tuple[RunStatus, bool] | None:
        statement, extra = audited(self._db, "run_delete")
        params = {"environment": environment, "id": run_id, **extra}

        def delete(conn: Conn) -> tuple[RunStatus, bool] | None:
            row = conn.execute(self._sql[statement], params).fetchone()
            return None if row is None else (RunStatus(row[0]), bool(row[1]))

        return self._db.run(delete)
