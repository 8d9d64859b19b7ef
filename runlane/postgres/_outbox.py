"""The outbox repository: a transport lane's outbox items (publishers claim, extend and
record them, fenced by claim tokens), the producer's switch, the consumer's delivery state
and WAL flush, and the lane's maintenance and status reads. The statements are in
``sql/outbox.sql`` and the triggers that write items in migration 3; the eager trigger path
is ``_eager.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from psycopg.rows import dict_row

from runlane.models import RunStatus
from runlane.postgres._connections import Conn
from runlane.postgres._executor import Executor
from runlane.storage import DeliveryState, FailingQueue, OutboxItem, OutboxStatus

__all__ = ["OutboxRepository"]


class OutboxRepository:
    """Outbox statements (the contract is ``Outbox``'s, in ``_transport.py``)."""

    def __init__(self, db: Executor) -> None:
        self._db = db
        self._sql = db.sql

    def _fenced(self, name: str, items: Sequence[OutboxItem], **extra: Any) -> set[uuid.UUID]:
        """Statement ``name`` on the items still under their claims (id, claim token and
        environment); returns the ids it applied to. Let through while the storage closes:
        the publisher records its eager items then."""
        if not items:
            return set()
        # by id: every fenced write locks its rows in one order, so two publishers writing
        # items they both touched (an expired claim taken over) wait, never deadlock
        items = sorted(items, key=lambda i: i.id)
        params = {
            "ids": [i.id for i in items],
            "tokens": [i.claim_token for i in items],
            "environments": [i.environment for i in items],
            **extra,
        }
        return self._db.run(
            lambda conn: {row[0] for row in conn.execute(self._sql[name], params)},
            draining=True,
        )

    def outbox_enable(self, environment: str, claim: timedelta) -> None:
        params = {"environment": environment, "claim_seconds": claim.total_seconds()}
        self._db.run(lambda conn: conn.execute(self._sql["outbox_enable"], params))

    def outbox_claim_page(self, environment: str, limit: int, claim: timedelta) -> list[OutboxItem]:
        params = {
            "environment": environment,
            "limit": limit,
            "claim_seconds": claim.total_seconds(),
        }
        return self._db.run(
            lambda conn: [
                OutboxItem(*row) for row in conn.execute(self._sql["outbox_claim_page"], params)
            ]
        )

    def outbox_extend(self, items: Sequence[OutboxItem], claim: timedelta) -> set[uuid.UUID]:
        return self._fenced("outbox_extend", items, claim_seconds=claim.total_seconds())

    def outbox_published(self, items: Sequence[OutboxItem]) -> set[uuid.UUID]:
        return self._fenced("outbox_published", items)

    def outbox_unclaim(self, items: Sequence[OutboxItem]) -> set[uuid.UUID]:
        return self._fenced("outbox_unclaim", items)

    def outbox_failed(
        self, items: Sequence[OutboxItem], error: str, delay: timedelta
    ) -> set[uuid.UUID]:
        return self._fenced(
            "outbox_failed",
            items,
            errors=[error[:2000]] * len(items),
            delay_seconds=[delay.total_seconds()] * len(items),
        )

    def outbox_next_due(self, environment: str) -> float | None:
        params = {"environment": environment}

        def next_due(conn: Conn) -> float | None:
            row = conn.execute(self._sql["outbox_next_due"], params).fetchone()
            return None if row is None or row[0] is None else float(row[0])

        return self._db.run(next_due)

    def outbox_defer(self, environment: str, run_ids: Sequence[uuid.UUID], delay: timedelta) -> int:
        if not run_ids:
            return 0
        params = {
            "environment": environment,
            "ids": list(run_ids),
            "delay_seconds": delay.total_seconds(),
        }
        return self._db.run(
            lambda conn: len(conn.execute(self._sql["outbox_defer"], params).fetchall())
        )

    def outbox_recover(self, environment: str, threshold: timedelta, limit: int) -> int:
        params = {
            "environment": environment,
            "threshold_seconds": threshold.total_seconds(),
            "limit": limit,
        }
        return self._db.run(
            lambda conn: len(conn.execute(self._sql["outbox_recover"], params).fetchall())
        )

    def outbox_status(self, environment: str) -> OutboxStatus:
        def status(conn: Conn) -> OutboxStatus:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["outbox_status"], {"environment": environment})
                row = cur.fetchone()
            assert row is not None
            return OutboxStatus(
                pending=row["outbox_pending"], oldest_age_seconds=row["outbox_oldest_age_seconds"]
            )

        return self._db.run(status)

    def outbox_failing_queues(self, environment: str) -> list[FailingQueue]:
        params = {"environment": environment}

        def failing(conn: Conn) -> list[FailingQueue]:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["outbox_failing_queues"], params)
                return [FailingQueue(**row) for row in cur.fetchall()]

        return self._db.run(failing)

    def wal_flush(self) -> None:
        # on the pool: a connection that commits synchronously
        self._db.run(lambda conn: conn.execute(self._sql["wal_flush"]))

    def run_delivery_state(
        self, environment: str, run_ids: Sequence[uuid.UUID]
    ) -> dict[uuid.UUID, DeliveryState]:
        if not run_ids:
            return {}
        params = {"environment": environment, "ids": list(run_ids)}
        return self._db.run(
            lambda conn: {
                row[0]: DeliveryState(RunStatus(row[1]), row[2], bool(row[3]), bool(row[4]))
                for row in conn.execute(self._sql["run_delivery_state"], params)
            }
        )
