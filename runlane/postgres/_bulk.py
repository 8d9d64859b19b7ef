"""The Postgres storage's bulk actions (retry, cancel, delete by filter) and attempt progress.
Mixed into :class:`~runlane.postgres.PostgresStorage`; the statements are in ``sql/bulk.sql``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from runlane.models import RunStatus
from runlane.postgres._connections import Conn
from runlane.storage import BulkBatch, BulkFilter, ProgressWrite

__all__ = ["BulkMethods"]

T = TypeVar("T")

# a walk starts above every run: no created_at reaches infinity
_TOP = ("infinity", uuid.UUID(int=2**128 - 1))
_STATEMENTS = {"retry": "run_bulk_retry", "cancel": "run_bulk_cancel", "delete": "run_bulk_delete"}


def _filter_params(runs: BulkFilter) -> dict[str, Any]:
    return {
        "environment": runs.environment,
        "task_id": runs.task_id,
        "queue": runs.queue,
        "created_after": runs.created_after,
        "created_before": runs.created_before,
    }


class BulkMethods:
    """Bulk and progress statements; expects the attributes PostgresStorage has."""

    _sql: dict[str, str]

    def _with_conn(self, fn: Callable[[Conn], T]) -> T:
        raise NotImplementedError

    def run_bulk_count(self, runs: BulkFilter, limit: int) -> int:
        params = {
            **_filter_params(runs),
            "statuses": [status.value for status in runs.statuses],
            "limit": limit,
        }

        def count(conn: Conn) -> int:
            row = conn.execute(self._sql["run_bulk_count"], params).fetchone()
            return 0 if row is None else int(row[0])

        return self._with_conn(count)

    def run_bulk_batch(
        self,
        action: str,
        runs: BulkFilter,
        status: RunStatus,
        before: tuple[datetime, uuid.UUID] | None,
        size: int,
    ) -> BulkBatch:
        before_created_at, before_id = _TOP if before is None else before
        params = {
            **_filter_params(runs),
            "status": status.value,
            "before_created_at": before_created_at,
            "before_id": before_id,
            "batch": size,
        }
        statement = self._sql[_STATEMENTS[action]]

        def batch(conn: Conn) -> BulkBatch:
            # one statement in autocommit: the batch is its own transaction
            row = conn.execute(statement, params).fetchone()
            assert row is not None
            last = None if row[2] is None else (row[2], row[3])
            return BulkBatch(visited=int(row[0]), changed=int(row[1]), last=last)

        return self._with_conn(batch)

    def run_progress_many(self, writes: Sequence[ProgressWrite]) -> set[uuid.UUID]:
        if not writes:
            return set()
        params = {
            "ids": [w.lease.run_id for w in writes],
            "attempts": [w.lease.attempt for w in writes],
            "lease_tokens": [w.lease.lease_token for w in writes],
            "progress": "[" + ",".join(w.progress for w in writes) + "]",
        }
        return self._with_conn(
            lambda conn: {row[0] for row in conn.execute(self._sql["run_progress_many"], params)}
        )
