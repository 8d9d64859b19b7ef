"""The maintenance repository: the bands' leases and fences, and the phases' writes on runs
(due delivery, attempt expiry, wake-ups of delayed queues, cleanup). Statements:
``sql/maintenance.sql``; cleanup's deletion is ``run_prune_ids`` (``sql/bulk.sql``), which
bulk deletes share (:func:`prune_ids`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

import attrs

from runlane.models import RunStatus
from runlane.postgres._connections import Conn, own_transaction
from runlane.postgres._executor import Executor
from runlane.storage import (
    Expiration,
    ExpiredAttempt,
    FailureApplied,
    MaintenanceFence,
    MaintenanceLeaseRow,
    PruneResult,
)

__all__ = ["MaintenanceRepository", "prune_ids"]


def prune_ids(
    conn: Conn,
    statement: str,
    environment: str,
    ids: list[uuid.UUID],
    *,
    skip_locked: bool,
    extra: Mapping[str, str] | None = None,
) -> tuple[int, int]:
    """run_prune_ids (``statement``, with its ``extra`` parameters: an audited twin's
    action) on these runs (those another transaction holds left alone with skip_locked,
    else waited for): (deleted, tombstoned)."""
    if not ids:
        return 0, 0
    params = {"environment": environment, "ids": ids, "skip_locked": skip_locked, **(extra or {})}
    row = conn.execute(statement, params).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


class MaintenanceRepository:
    """Leases of the maintenance bands and the writes of their phases (fenced when a
    band's fence is given)."""

    def __init__(self, db: Executor) -> None:
        self._db = db

    def database_now(self) -> datetime:
        def now(conn: Conn) -> datetime:
            row = conn.execute(self._db.sql["database_now"]).fetchone()
            assert row is not None
            value: datetime = row[0]
            return value

        return self._db.run(now)

    def run_deliver_due(
        self, environment: str, limit: int, *, fence: MaintenanceFence | None = None
    ) -> int:
        params = {"environment": environment, "limit": limit}
        statement = self._db.sql["run_deliver_due"]
        return self._db.fenced(fence, lambda conn: len(conn.execute(statement, params).fetchall()))

    def run_list_expired(self, environment: str, limit: int) -> list[ExpiredAttempt]:
        params = {"environment": environment, "limit": limit}
        statement = self._db.sql["run_list_expired"]

        def listed(conn: Conn) -> list[ExpiredAttempt]:
            return [
                ExpiredAttempt(
                    run_id=row[0],
                    task_id=row[1],
                    attempt=row[2],
                    attempts_consumed=row[3],
                    max_attempts=row[4],
                    lease_token=row[5],
                    lease_expires_at=row[6],
                )
                for row in conn.execute(statement, params).fetchall()
            ]

        return self._db.run(listed)

    def run_expire_many(
        self, expirations: Sequence[Expiration], *, fence: MaintenanceFence | None = None
    ) -> list[FailureApplied]:
        if not expirations:
            return []
        params = {
            "ids": [e.run_id for e in expirations],
            "attempts": [e.attempt for e in expirations],
            "lease_tokens": [e.lease_token for e in expirations],
            "errors": [e.error for e in expirations],
            "retry_delay_seconds": [
                None if e.retry_delay is None else e.retry_delay.total_seconds()
                for e in expirations
            ],
        }
        statement = self._db.sql["run_expire_many"]
        return self._db.fenced(
            fence,
            lambda conn: [
                FailureApplied(run_id=row[0], status=RunStatus(row[1]))
                for row in conn.execute(statement, params).fetchall()
            ],
        )

    def run_wake_due_queues(self, environment: str, window: timedelta, limit: int) -> list[str]:
        params = {
            "environment": environment,
            "window_seconds": window.total_seconds(),
            "limit": limit,
        }
        statement = self._db.sql["run_wake_due_queues"]
        return self._db.run(lambda conn: [row[1] for row in conn.execute(statement, params)])

    def run_prune(
        self,
        environment: str,
        retention: dict[RunStatus, timedelta],
        limit: int,
        *,
        fence: MaintenanceFence | None = None,
    ) -> PruneResult:
        params = {
            "environment": environment,
            "limit": limit,
            "completed_seconds": retention[RunStatus.COMPLETED].total_seconds(),
            "failed_seconds": retention[RunStatus.FAILED].total_seconds(),
            "cancelled_seconds": retention[RunStatus.CANCELLED].total_seconds(),
        }
        sql = self._db.sql

        def prune(conn: Conn) -> PruneResult:
            # run_prune picks and locks; run_prune_ids, delete_runs' too, deletes what it
            # picked in the same transaction (the fence's when fenced), so the locks hold
            with own_transaction(conn):
                ids = [row[0] for row in conn.execute(sql["run_prune"], params)]
                deleted, tombstoned = prune_ids(
                    conn, sql["run_prune_ids"], environment, ids, skip_locked=False
                )
            return PruneResult(deleted=deleted, tombstoned=tombstoned)

        return self._db.fenced(fence, prune)

    # -- the bands' leases -----------------------------------------------------------------

    def maintenance_lease_acquire(
        self, environment: str, band: str, owner: uuid.UUID, lease: timedelta
    ) -> int | None:
        params = {
            "environment": environment,
            "band": band,
            "owner": owner,
            "lease_seconds": lease.total_seconds(),
        }

        def acquire(conn: Conn) -> int | None:
            row = conn.execute(self._db.sql["maintenance_lease_acquire"], params).fetchone()
            return None if row is None else int(row[0])

        return self._db.run(acquire)

    def maintenance_lease_refresh(self, fence: MaintenanceFence, lease: timedelta) -> bool:
        params = {**attrs.asdict(fence), "lease_seconds": lease.total_seconds()}
        statement = self._db.sql["maintenance_lease_refresh"]
        return self._db.run(lambda conn: conn.execute(statement, params).fetchone() is not None)

    def maintenance_lease_release(self, fence: MaintenanceFence) -> bool:
        params = attrs.asdict(fence)
        statement = self._db.sql["maintenance_lease_release"]
        return self._db.run(lambda conn: conn.execute(statement, params).fetchone() is not None)

    def maintenance_lease_list(self, environment: str) -> list[MaintenanceLeaseRow]:
        params = {"environment": environment}
        statement = self._db.sql["maintenance_lease_list"]
        return self._db.run(
            lambda conn: [MaintenanceLeaseRow(*row) for row in conn.execute(statement, params)]
        )

    def maintenance_missing(self, environment: str) -> bool:
        params = {"environment": environment}

        def missing(conn: Conn) -> bool:
            row = conn.execute(self._db.sql["maintenance_missing"], params).fetchone()
            return bool(row and row[0])

        return self._db.run(missing)
