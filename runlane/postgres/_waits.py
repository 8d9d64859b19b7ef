"""The waits repository: an attempt's durable steps, its suspension on a token, a run or a
time and its release, wait tokens, and resuming the runs whose wait ended. Statements:
``sql/waits.sql``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from psycopg.rows import dict_row

from runlane.models import WaitToken, WaitTokenStatus
from runlane.postgres._connections import Conn
from runlane.postgres._executor import Executor
from runlane.storage import LeaseRef, MaintenanceFence, StepStored, SuspendResult

__all__ = ["WaitRepository"]


def _one_lease(lease: LeaseRef) -> dict[str, Any]:
    return {"id": lease.run_id, "attempt": lease.attempt, "lease_token": lease.lease_token}


class WaitRepository:
    """Steps and waits: the attempt's writes fenced by its lease, tokens by environment."""

    def __init__(self, db: Executor) -> None:
        self._db = db

    def step_get(self, run_id: uuid.UUID, name: str) -> tuple[bool, Any]:
        params = {"run_id": run_id, "name": name}

        def get(conn: Conn) -> tuple[bool, Any]:
            row = conn.execute(self._db.sql["step_get"], params).fetchone()
            return (False, None) if row is None else (True, row[0])

        return self._db.run(get)

    def step_store(self, lease: LeaseRef, name: str, output: str) -> StepStored:
        params = {**_one_lease(lease), "name": name, "output": output}
        sql = self._db.sql

        def store(conn: Conn) -> StepStored:
            row = conn.execute(sql["step_store"], params).fetchone()
            assert row is not None
            fenced, stored = bool(row[0]), row[1]
            if fenced and stored is None:  # an earlier writer won: answer with its output
                found = conn.execute(
                    sql["step_get"], {"run_id": lease.run_id, "name": name}
                ).fetchone()
                stored = None if found is None else found[0]
            return StepStored(fenced=fenced, output=stored)

        return self._db.run(store)

    def run_suspend(
        self,
        lease: LeaseRef,
        environment: str,
        *,
        token_id: uuid.UUID | None = None,
        run_id: uuid.UUID | None = None,
        wake_at: datetime | None = None,
    ) -> SuspendResult:
        if sum(x is not None for x in (token_id, run_id, wake_at)) != 1:
            raise ValueError("suspend on exactly one of token_id, run_id, wake_at")
        kind = "token" if token_id is not None else "run" if run_id is not None else "sleep"
        params = {
            **_one_lease(lease),
            "environment": environment,
            "kind": kind,
            "target_id": token_id if token_id is not None else run_id,
            "wake_at": wake_at,
        }

        def suspend(conn: Conn) -> SuspendResult:
            row = conn.execute(self._db.sql["run_suspend"], params).fetchone()
            assert row is not None
            return SuspendResult(target_open=bool(row[0]), suspended=bool(row[1]))

        return self._db.run(suspend)

    def run_release(self, lease: LeaseRef, delay: timedelta) -> bool:
        params = {**_one_lease(lease), "delay_seconds": delay.total_seconds()}

        def release(conn: Conn) -> bool:
            row = conn.execute(self._db.sql["run_release"], params).fetchone()
            return row is not None and row[0] > 0

        return self._db.run(release)

    def run_resume_waiters(
        self,
        environment: str,
        limit: int,
        *,
        token_ids: Sequence[uuid.UUID] | None = None,
        run_ids: Sequence[uuid.UUID] | None = None,
        fence: MaintenanceFence | None = None,
    ) -> int:
        narrowed = token_ids is not None or run_ids is not None
        params = {
            "environment": environment,
            "limit": limit,
            "token_ids": list(token_ids or []) if narrowed else None,
            "run_ids": list(run_ids or []) if narrowed else None,
        }
        statement = self._db.sql["run_resume_waiters"]
        return self._db.fenced(fence, lambda conn: len(conn.execute(statement, params).fetchall()))

    # -- wait tokens -----------------------------------------------------------------------

    def wait_token_create(
        self,
        environment: str,
        token_id: uuid.UUID,
        timeout: timedelta | None,
        idempotency_key: str | None,
    ) -> WaitToken:
        params = {
            "environment": environment,
            "id": token_id,
            "idempotency_key": idempotency_key,
            "timeout_seconds": None if timeout is None else timeout.total_seconds(),
        }

        def create(conn: Conn) -> WaitToken:
            conn.execute(self._db.sql["wait_token_insert"], params)
            token = self._token_row(conn, environment, token_id, idempotency_key)
            if token is None:
                raise RuntimeError(f"wait token {token_id} was neither created nor found")
            return token

        return self._db.run(create)

    def _token_row(
        self, conn: Conn, environment: str, token_id: uuid.UUID, key: str | None = None
    ) -> WaitToken | None:
        params = {"environment": environment, "id": token_id, "idempotency_key": key}
        with conn.cursor(row_factory=dict_row) as cur:
            cur.execute(self._db.sql["wait_token_get"], params)
            row = cur.fetchone()
        if row is None:
            return None
        return WaitToken(**{**row, "status": WaitTokenStatus(row["status"])})

    def wait_token_get(self, environment: str, token_id: uuid.UUID) -> WaitToken | None:
        return self._db.run(lambda conn: self._token_row(conn, environment, token_id))

    def wait_token_complete(self, environment: str, token_id: uuid.UUID, output: str) -> bool:
        params = {"environment": environment, "id": token_id, "output": output}
        statement = self._db.sql["wait_token_complete"]
        return self._db.run(lambda conn: conn.execute(statement, params).fetchone() is not None)

    def wait_token_time_out_due(
        self, environment: str, limit: int, *, fence: MaintenanceFence | None = None
    ) -> int:
        params = {"environment": environment, "limit": limit}
        statement = self._db.sql["wait_token_time_out_due"]
        return self._db.fenced(fence, lambda conn: len(conn.execute(statement, params).fetchall()))
