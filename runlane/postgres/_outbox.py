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


def _fenced(items: Sequence[OutboxItem]) -> dict[str, list[Any]]:
    """The parameters naming items under their claims: id, claim token and environment
    (a write applies to an item of that environment under that claim only)."""
    return {
        "ids": [i.id for i in items],
        "tokens": [i.claim_token for i in items],
        "environments": [i.environment for i in items],
    }


class OutboxRepository:
    """Outbox statements."""

    def __init__(self, db: Executor) -> None:
        self._db = db
        self._sql = db.sql

    # -- the producer side ---------------------------------------------------------------

    def outbox_enable(self, environment: str, claim: timedelta) -> None:
        """Runs of ``environment`` becoming queued get outbox items from now on."""
        params = {"environment": environment, "claim_seconds": claim.total_seconds()}
        self._db.run(lambda conn: conn.execute(self._sql["outbox_enable"], params))

    # -- publishers ----------------------------------------------------------------------

    def outbox_claim_page(self, environment: str, limit: int, claim: timedelta) -> list[OutboxItem]:
        """Claim up to ``limit`` publishable items of ``environment`` (never another's: its
        items may belong to a broker this publisher may not use), each under a fresh token
        that expires ``claim`` after database now."""
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
        """Extend to ``claim`` from database now the claims of the items that still hold
        theirs, unexpired; returns their ids. The others must not be published under it."""
        if not items:
            return set()
        params = {**_fenced(items), "claim_seconds": claim.total_seconds()}
        return self._db.run(
            lambda conn: {row[0] for row in conn.execute(self._sql["outbox_extend"], params)},
            draining=True,  # the publisher's eager items, published while the storage closes
        )

    def outbox_published(self, items: Sequence[OutboxItem]) -> set[uuid.UUID]:
        """Delete the items whose claim is still theirs; returns the ids deleted."""
        if not items:
            return set()
        params = _fenced(items)
        return self._db.run(
            lambda conn: {row[0] for row in conn.execute(self._sql["outbox_published"], params)},
            draining=True,  # the publisher's record, let through while the storage closes
        )

    def outbox_unclaim(self, items: Sequence[OutboxItem]) -> set[uuid.UUID]:
        """Give up the claim on the items still claimed by it, for a sweep to take them now
        (not a failure: the publisher would not publish them under a claim about to
        expire); returns the ids released."""
        if not items:
            return set()
        params = _fenced(items)
        return self._db.run(
            lambda conn: {row[0] for row in conn.execute(self._sql["outbox_unclaim"], params)},
            draining=True,  # the publisher's record, let through while the storage closes
        )

    def outbox_failed(
        self, items: Sequence[OutboxItem], error: str, delay: timedelta
    ) -> set[uuid.UUID]:
        """Release the items whose claim is still theirs for a try after ``delay``."""
        if not items:
            return set()
        params = {
            **_fenced(items),
            "errors": [error[:2000]] * len(items),
            "delay_seconds": [delay.total_seconds()] * len(items),
        }
        return self._db.run(
            lambda conn: {row[0] for row in conn.execute(self._sql["outbox_failed"], params)},
            draining=True,  # the publisher's record, let through while the storage closes
        )

    def outbox_next_due(self, environment: str) -> float | None:
        """Seconds until the next item of ``environment`` becomes publishable (<= 0: now),
        None when none: unclaimed items when available, claimed ones when their claim
        expires."""
        params = {"environment": environment}

        def next_due(conn: Conn) -> float | None:
            row = conn.execute(self._sql["outbox_next_due"], params).fetchone()
            return None if row is None or row[0] is None else float(row[0])

        return self._db.run(next_due)

    def outbox_defer(self, environment: str, run_ids: Sequence[uuid.UUID], delay: timedelta) -> int:
        """Publish the still-queued runs again after ``delay`` (or their due time)."""
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
        """Announce again runs queued past ``threshold`` that have no outbox item."""
        params = {
            "environment": environment,
            "threshold_seconds": threshold.total_seconds(),
            "limit": limit,
        }
        return self._db.run(
            lambda conn: len(conn.execute(self._sql["outbox_recover"], params).fetchall())
        )

    def outbox_status(self, environment: str) -> OutboxStatus:
        """Pending items of ``environment`` and the oldest one's age."""

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
        """Per queue whose items failed to publish twice or more: how many, the most
        failures of one, the worst item's error and the oldest one's age."""
        params = {"environment": environment}

        def failing(conn: Conn) -> list[FailingQueue]:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["outbox_failing_queues"], params)
                return [FailingQueue(**row) for row in cur.fetchall()]

        return self._db.run(failing)

    # -- consumers -----------------------------------------------------------------------

    def wal_flush(self) -> None:
        """Return once the WAL is flushed past every commit that returned before this call,
        asynchronous ones (a dedicated view's with ``durable_commits=False``) included.
        Needs a connection that commits synchronously (the pool's)."""
        self._db.run(lambda conn: conn.execute(self._sql["wal_flush"]))

    def run_delivery_state(
        self, environment: str, run_ids: Sequence[uuid.UUID]
    ) -> dict[uuid.UUID, DeliveryState]:
        """Status, queue, dueness and queue pause of the named runs that exist."""
        if not run_ids:
            return {}
        params = {"environment": environment, "ids": list(run_ids)}
        return self._db.run(
            lambda conn: {
                row[0]: DeliveryState(RunStatus(row[1]), row[2], bool(row[3]), bool(row[4]))
                for row in conn.execute(self._sql["run_delivery_state"], params)
            }
        )
