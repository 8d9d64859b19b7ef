"""The attempts repository: claims (polling, bounded, by id) and the fenced lifecycle
writes of the attempts they start (complete, fail, hand back, started, lease extension with
the worker's heartbeat, progress). Statements: ``sql/claims.sql``, ``sql/lifecycle.sql``;
the flow-controlled claim is ``_flow.py``'s.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import attrs
import psycopg

from runlane.models import RunStatus
from runlane.postgres._batches import too_large
from runlane.postgres._connections import Conn
from runlane.postgres._executor import Executor
from runlane.postgres._inserts import array_literal
from runlane.storage import (
    ClaimedRun,
    Completion,
    Failure,
    FailureApplied,
    LeaseRef,
    OutputRefused,
    ProgressWrite,
    WorkerBeat,
)

__all__ = ["CLAIM_FIELDS", "AttemptRepository", "claimed"]

# the columns of a claim's row: ClaimedRun's fields, in their order and under their names,
# as the SQL fragment claim_returning (sql/fragments.sql) gives them (a test compares the
# names); rows may carry more columns after them (the flow-control claim's rate wait)
CLAIM_FIELDS = tuple(f.name for f in attrs.fields(ClaimedRun) if f.init)
_CLAIM_WIDTH = len(CLAIM_FIELDS)

_BEAT_FIELDS = (
    "worker_id",
    "environment",
    "host",
    "pid",
    "runlane_version",
    "queues",
    "concurrency",
    "heartbeat_seconds",
    "worker_state",
)


def claimed(rows: Sequence[tuple[Any, ...]]) -> list[ClaimedRun]:
    return [ClaimedRun(*row[:_CLAIM_WIDTH]) for row in rows]


def _claim_params(
    environment: str,
    queues: Sequence[str],
    limit: int,
    lease: timedelta,
    worker_id: uuid.UUID | None,
) -> dict[str, Any]:
    """run_claim's parameters (no concurrency limit: a bounded queue claims elsewhere)."""
    return {
        "environment": environment,
        "queues": list(queues),
        "limit": limit,
        "lease_seconds": lease.total_seconds(),
        "concurrency_limit": None,
        "worker_id": worker_id,
    }


class AttemptRepository:
    """Claims and the lifecycle writes, each fenced by run, attempt and lease token."""

    def __init__(self, db: Executor) -> None:
        self._db = db

    # -- claims --------------------------------------------------------------------------

    def run_claim(
        self,
        environment: str,
        queues: Sequence[str],
        limit: int,
        lease: timedelta,
        *,
        worker_id: uuid.UUID | None = None,
    ) -> list[ClaimedRun]:
        params = _claim_params(environment, queues, limit, lease, worker_id)
        statement = self._db.sql["run_claim"]
        return self._db.run(lambda conn: claimed(conn.execute(statement, params).fetchall()))

    def run_claim_or_next_due(
        self,
        environment: str,
        queues: Sequence[str],
        limit: int,
        lease: timedelta,
        *,
        worker_id: uuid.UUID | None = None,
        due_queues: Sequence[str],
    ) -> tuple[list[ClaimedRun], float | None]:
        """``run_claim`` of ``queues`` (none: claims nothing) and, when it claims nothing,
        the seconds (the database's now) until the earliest queued run of ``due_queues``
        that is not yet due comes due (None: none waits for its time), in one transaction:
        an idle worker's spaced-out poll."""
        params = _claim_params(environment, queues, limit, lease, worker_id)
        due = {"environment": environment, "queues": list(due_queues)}
        claim, next_due = self._db.sql["run_claim"], self._db.sql["run_next_due"]

        def both(conn: Conn) -> tuple[list[ClaimedRun], float | None]:
            with conn.transaction():  # one transaction: an idle worker's poll stays one
                runs = claimed(conn.execute(claim, params).fetchall()) if queues else []
                if runs:
                    return runs, None
                row = conn.execute(next_due, due).fetchone()
            return [], None if row is None or row[0] is None else float(row[0])

        return self._db.run(both)

    def run_claim_bounded(
        self,
        environment: str,
        queue: str,
        concurrency_limit: int,
        limit: int,
        lease: timedelta,
        *,
        worker_id: uuid.UUID | None = None,
    ) -> list[ClaimedRun]:
        params = {
            "environment": environment,
            "queue": queue,
            "queues": [queue],
            "concurrency_limit": concurrency_limit,
            "limit": limit,
            "lease_seconds": lease.total_seconds(),
            "worker_id": worker_id,
            "lock_scope": self._db.lock_scope(environment),
        }
        return self._db.run(lambda conn: self._locked_claim(conn, "run_claim", params))

    def run_claim_ids(
        self,
        environment: str,
        run_ids: Sequence[uuid.UUID],
        lease: timedelta,
        *,
        queue: str | None = None,
        concurrency_limit: int | None = None,
        worker_id: uuid.UUID | None = None,
    ) -> list[ClaimedRun]:
        """Claim the named runs that are queued and due, with the same fenced claim as
        ``run_claim``; for a bounded ``queue`` (all ids of that queue) at most as many as
        its ``concurrency_limit`` leaves, under the queue's claim lock."""
        if not run_ids:
            return []
        params = {
            "environment": environment,
            "ids": list(run_ids),
            "queue": queue,
            "concurrency_limit": concurrency_limit,
            "lease_seconds": lease.total_seconds(),
            "lock_scope": self._db.lock_scope(environment),
            "worker_id": worker_id,
        }
        if concurrency_limit is not None:
            return self._db.run(lambda conn: self._locked_claim(conn, "run_claim_ids", params))
        statement = self._db.sql["run_claim_ids"]
        return self._db.run(lambda conn: claimed(conn.execute(statement, params).fetchall()))

    def _locked_claim(self, conn: Conn, name: str, params: dict[str, Any]) -> list[ClaimedRun]:
        # two statements, one transaction: the count must come after the queue's lock
        with conn.transaction():
            conn.execute(self._db.sql["queue_claim_lock"], params)
            return claimed(conn.execute(self._db.sql[name], params).fetchall())

    # -- lifecycle -----------------------------------------------------------------------

    def run_complete_many(self, completions: Sequence[Completion]) -> set[uuid.UUID]:
        if not completions:
            return set()
        params = {
            "ids": array_literal(c.run_id for c in completions),
            "attempts": array_literal(c.attempt for c in completions),
            "lease_tokens": array_literal(c.lease_token for c in completions),
            "outputs": "[" + ",".join(c.output for c in completions) + "]",
        }
        statement = self._db.sql["run_complete_many"]

        def complete(conn: Conn) -> set[uuid.UUID]:
            try:
                return {row[0] for row in conn.execute(statement, params)}
            except psycopg.Error as exc:
                if too_large(exc):
                    raise OutputRefused(exc.diag.message_primary) from exc
                raise

        return self._db.run(complete)

    def run_fail_many(self, failures: Sequence[Failure]) -> list[FailureApplied]:
        if not failures:
            return []
        params = {
            "ids": [f.run_id for f in failures],
            "attempts": [f.attempt for f in failures],
            "lease_tokens": [f.lease_token for f in failures],
            "errors": [f.error for f in failures],
            "retry_delay_seconds": [
                None if f.retry_delay is None else f.retry_delay.total_seconds() for f in failures
            ],
        }
        statement = self._db.sql["run_fail_many"]
        return self._db.run(
            lambda conn: [
                FailureApplied(run_id=row[0], status=RunStatus(row[1]))
                for row in conn.execute(statement, params).fetchall()
            ]
        )

    def run_release_many(self, environment: str, leases: Sequence[LeaseRef]) -> set[uuid.UUID]:
        if not leases:
            return set()
        params = _lease_params(leases)
        statement = self._db.sql["run_release_many"]
        return self._db.run(lambda conn: {row[0] for row in conn.execute(statement, params)})

    def run_mark_started(self, leases: Sequence[LeaseRef]) -> int:
        if not leases:
            return 0
        params = _lease_params(leases)
        statement = self._db.sql["run_mark_started"]
        return self._db.run(lambda conn: len(conn.execute(statement, params).fetchall()))

    def run_extend_leases(
        self, leases: Sequence[LeaseRef], lease: timedelta, *, beat: WorkerBeat | None = None
    ) -> dict[LeaseRef, RunStatus]:
        if not leases and beat is None:
            return {}
        params = {
            **_lease_params(leases),
            **_beat_params(beat),
            "lease_seconds": lease.total_seconds(),
        }
        statement = self._db.sql["run_extend_leases"]
        return self._db.run(
            lambda conn: {
                LeaseRef(row[0], row[1], row[2]): RunStatus(row[3])
                for row in conn.execute(statement, params).fetchall()
            }
        )

    def run_progress_many(self, writes: Sequence[ProgressWrite]) -> set[uuid.UUID]:
        if not writes:
            return set()
        params = {
            "ids": [w.lease.run_id for w in writes],
            "attempts": [w.lease.attempt for w in writes],
            "lease_tokens": [w.lease.lease_token for w in writes],
            "progress": "[" + ",".join(w.progress for w in writes) + "]",
        }
        statement = self._db.sql["run_progress_many"]
        return self._db.run(lambda conn: {row[0] for row in conn.execute(statement, params)})


def _lease_params(leases: Sequence[LeaseRef]) -> dict[str, Any]:
    return {
        "ids": array_literal(ref.run_id for ref in leases),
        "attempts": array_literal(ref.attempt for ref in leases),
        "lease_tokens": array_literal(ref.lease_token for ref in leases),
    }


def _beat_params(beat: WorkerBeat | None) -> dict[str, Any]:
    """The heartbeat's parameters of run_extend_leases (all None: no heartbeat)."""
    if beat is None:
        return dict.fromkeys(_BEAT_FIELDS)
    return {
        "worker_id": beat.worker_id,
        "environment": beat.environment,
        "host": beat.host,
        "pid": beat.pid,
        "runlane_version": beat.runlane_version,
        "queues": list(beat.queues),
        "concurrency": beat.concurrency,
        "heartbeat_seconds": beat.heartbeat_seconds,
        "worker_state": beat.state.value,
    }
