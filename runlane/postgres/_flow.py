"""The flow repository: the claim of queues with rate limits and per-key concurrency.

The statement is ``run_claim_limited`` in ``sql/flow.sql`` and its tables are migration 8's.
One statement serves the polling claim (the queue's next runs) and the claim by id of a
transport lane's deliveries.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import timedelta

from runlane.postgres._attempts import claimed
from runlane.postgres._connections import Conn
from runlane.postgres._executor import Executor
from runlane.storage import LimitedClaim, QueueLimits

__all__ = ["EVERY_KEY", "KEY_VISIT_LIMIT", "FlowRepository"]

#: keys one polling claim of a keyed queue may look at (those at their limit, and those
#: whose queued runs are not due yet, are passed over): a bound on one claim's work
KEY_VISIT_LIMIT = 1_000
#: the visit limit of a claim that walks every key: what drain() claims with after a
#: claim stopped at KEY_VISIT_LIMIT keys without a run (the statement's int4 parameter)
EVERY_KEY = 2**31 - 1


class FlowRepository:
    """The limited claim."""

    def __init__(self, db: Executor) -> None:
        self._db = db

    def run_claim_limited(
        self,
        environment: str,
        queue: str,
        limits: QueueLimits,
        limit: int,
        lease: timedelta,
        *,
        worker_id: uuid.UUID | None = None,
        run_ids: Sequence[uuid.UUID] | None = None,
        visit_limit: int | None = None,
    ) -> LimitedClaim:
        params = {
            "environment": environment,
            "queue": queue,
            "limit": limit,
            "lease_seconds": lease.total_seconds(),
            "worker_id": worker_id,
            "ids": None if run_ids is None else list(run_ids),
            "concurrency_limit": limits.concurrency_limit,
            "key_limit": limits.key_limit,
            "rate_count": limits.rate_count,
            "rate_per_us": limits.rate_per_us,
            "rate_burst": limits.rate_burst,
            "visit_limit": KEY_VISIT_LIMIT if visit_limit is None else visit_limit,
            "lock_scope": self._db.lock_scope(environment),
        }

        sql = self._db.sql

        def claim(conn: Conn) -> LimitedClaim:
            # two statements, one transaction: every count comes after the queue's lock
            with conn.transaction():
                conn.execute(sql["queue_claim_lock_flow"], params)
                rows = conn.execute(sql["run_claim_limited"], params).fetchall()
            # the last row carries the rate limit's wait and whether the walk stopped at
            # its visit limit; the others are the claimed runs
            *claimed_rows, (*_, wait, walked_on) = rows
            return LimitedClaim(
                runs=claimed(claimed_rows),
                rate_wait=None if wait is None else float(wait),
                walked_on=bool(walked_on),
            )

        return self._db.run(claim)
