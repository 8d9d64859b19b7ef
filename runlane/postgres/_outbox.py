"""The Postgres storage's outbox methods (transport lanes) and claims by run id.

Mixed into :class:`~runlane.postgres.PostgresStorage`; the statements are in
``sql/outbox.sql`` and the triggers that write items in migration 3.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import psycopg
from psycopg.rows import TupleRow, dict_row

from runlane.models import RunStatus
from runlane.postgres._batches import pipelined, refusing_too_large, split_runs
from runlane.postgres._connections import Conn
from runlane.postgres._group import group_row, group_rows
from runlane.postgres._pq import RawStatement
from runlane.storage import (
    ClaimedRun,
    DeliveryState,
    FailingQueue,
    InsertedRun,
    NewRuns,
    OutboxItem,
    OutboxStatus,
)

__all__ = ["EagerPublisher", "OutboxMethods", "eager_item_id"]

T = TypeVar("T")


def _fenced(items: Sequence[OutboxItem]) -> dict[str, list[Any]]:
    """The parameters naming items under their claims: id, claim token and environment
    (a write applies to an item of that environment under that claim only)."""
    return {
        "ids": [i.id for i in items],
        "tokens": [i.claim_token for i in items],
        "environments": [i.environment for i in items],
    }


def eager_item_id(claim: uuid.UUID, run_id: uuid.UUID) -> uuid.UUID:
    """The id the insert trigger gives an eagerly claimed item: md5(claim || run id)."""
    return uuid.UUID(hashlib.md5(f"{claim}{run_id}".encode(), usedforsecurity=False).hexdigest())


class EagerPublisher(Protocol):
    """Publishes the items of an eager trigger after its commit (a transport lane's).

    ``claimed_at`` is the ``time.monotonic()`` taken before the statement that claimed them
    was sent: their claim started later, so the publisher can tell, from its own elapsed
    time and no stored time, when the claim is about to expire. ``submit`` must not block
    on the transport (the caller is the triggering thread); closing the storage the
    publisher is attached to closes it, within the storage's timeout. Public as
    ``runlane.postgres.EagerPublisher``."""

    def submit(self, items: Sequence[OutboxItem], claimed_at: float | None = None) -> None: ...

    def close(self, timeout: float | None = ...) -> None: ...


class OutboxMethods:
    """Outbox statements; expects the attributes PostgresStorage has."""

    schema: str
    _sql: dict[str, str]
    _eager: EagerPublisher | None
    _raw: dict[str, RawStatement]

    def _with_conn(self, fn: Callable[[Conn], T], *, draining: bool = False) -> T:
        raise NotImplementedError

    def _claimed_rows(self, rows: Sequence[tuple[Any, ...]]) -> list[ClaimedRun]:
        raise NotImplementedError

    def _insert_params(self, runs: NewRuns, *, one: bool = False) -> dict[str, Any]:
        raise NotImplementedError

    def _resolve_inserted(
        self, conn: Conn, runs: NewRuns, inserted: set[uuid.UUID]
    ) -> list[InsertedRun]:
        raise NotImplementedError

    def _resolve_conflicts(
        self, cur: psycopg.Cursor[TupleRow], runs: NewRuns, inserted: set[uuid.UUID]
    ) -> list[InsertedRun]:
        raise NotImplementedError

    def _group_handles(
        self, conn: Conn, groups: Sequence[NewRuns], inserted: set[uuid.UUID] | None
    ) -> list[list[InsertedRun]]:
        raise NotImplementedError

    # -- the producer side ---------------------------------------------------------------

    def outbox_enable(self, environment: str, claim: timedelta) -> None:
        """Runs of ``environment`` becoming queued get outbox items from now on."""
        params = {"environment": environment, "claim_seconds": claim.total_seconds()}
        self._with_conn(lambda conn: conn.execute(self._sql["outbox_enable"], params))

    def _insert_eager(self, runs: NewRuns, publisher: EagerPublisher) -> list[InsertedRun]:
        """Insert with the items of runs due now already claimed; hand them to the publisher
        once committed (a producer that dies now leaves them to be published after their
        claim expires)."""
        claim = uuid.uuid4()
        pieces = split_runs(runs)
        claimed_at = time.monotonic()  # before the statement: the claim starts after

        def insert(conn: Conn) -> tuple[list[InsertedRun], list[uuid.UUID]]:
            params = [{**self._insert_params(piece), "claim": str(claim)} for piece in pieces]
            rows = pipelined(conn, self._sql["run_insert_many_claimed"], params)
            made = self._resolve_inserted(conn, runs, {row[0] for row in rows})
            return made, [row[0] for row in rows if row[1]]

        made, due_now = self._with_conn(lambda conn: refusing_too_large(insert, conn, runs))
        if due_now:
            publisher.submit(
                [
                    OutboxItem(eager_item_id(claim, r), r, runs.environment, runs.queue, claim)
                    for r in due_now
                ],
                claimed_at,
            )
        return made

    def _insert_eager_alone(self, runs: NewRuns) -> list[InsertedRun]:
        """One groupable eager call by itself (a lone caller, or a call of a group that
        failed): the shared claimed statement with one row, through libpq (postgres/_pq.py),
        which measured cheaper for the client and the server alike than _insert_eager's
        run_insert_many_claimed through a cursor (benchmarks/README.md, session 6)."""
        return self._insert_eager_together([runs])[0]

    def _insert_eager_together(
        self,
        groups: Sequence[NewRuns],
        rows: str | None = None,
        committed: Callable[[], None] | None = None,
    ) -> list[list[InsertedRun]]:
        """The eager triggers of several calls in one statement and one commit (_group),
        their due items under one claim and handed to the publisher at once; each call's
        handles, in order. ``rows`` and ``committed`` as for _insert_together."""
        publisher = self._eager
        assert publisher is not None  # only called when one is attached
        claim = uuid.uuid4()
        if rows is None:
            rows = group_rows([group_row(r) for r in groups])
        params = {"rows": rows, "claim": str(claim)}
        claimed_at = time.monotonic()  # before the statement: the claim starts after

        keyed = any(key is not None for runs in groups for key in runs.idempotency_keys)

        def insert(conn: Conn) -> tuple[list[list[InsertedRun]], list[uuid.UUID]]:
            statement = "run_insert_group_claimed" if keyed else "run_insert_group_claimed_fresh"
            try:
                rows = [
                    (uuid.UUID(row[0]), row[1] == "t")
                    for row in self._raw[statement].rows(conn, params)
                    if row[0] is not None
                ]
            except psycopg.errors.UniqueViolation:
                if keyed:
                    raise
                # without keys nothing can conflict but a repeat after the first answer was
                # lost: its runs and their claimed items are there (autocommit: this failure
                # undid nothing); the runs are read back, and the items are published once
                # that claim expires
                rows = []
            if committed is not None:
                committed()
            made = self._group_handles(conn, groups, {row[0] for row in rows})
            return made, [run_id for run_id, due_now in rows if due_now]

        if len(groups) == 1:  # a call alone: its payload refused as too large, if it is
            made, due_now = self._with_conn(
                lambda conn: refusing_too_large(insert, conn, groups[0])
            )
        else:
            made, due_now = self._with_conn(insert)
        if due_now:
            where = {i: runs for runs in groups for i in runs.ids}
            publisher.submit(
                [
                    OutboxItem(
                        eager_item_id(claim, r), r, where[r].environment, where[r].queue, claim
                    )
                    for r in due_now
                ],
                claimed_at,
            )
        return made

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
        return self._with_conn(
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
        return self._with_conn(
            lambda conn: {row[0] for row in conn.execute(self._sql["outbox_extend"], params)},
            draining=True,  # the publisher's eager items, published while the storage closes
        )

    def outbox_published(self, items: Sequence[OutboxItem]) -> set[uuid.UUID]:
        """Delete the items whose claim is still theirs; returns the ids deleted."""
        if not items:
            return set()
        params = _fenced(items)
        return self._with_conn(
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
        return self._with_conn(
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
        return self._with_conn(
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

        return self._with_conn(next_due)

    def outbox_defer(self, environment: str, run_ids: Sequence[uuid.UUID], delay: timedelta) -> int:
        """Publish the still-queued runs again after ``delay`` (or their due time)."""
        if not run_ids:
            return 0
        params = {
            "environment": environment,
            "ids": list(run_ids),
            "delay_seconds": delay.total_seconds(),
        }
        return self._with_conn(
            lambda conn: len(conn.execute(self._sql["outbox_defer"], params).fetchall())
        )

    def outbox_recover(self, environment: str, threshold: timedelta, limit: int) -> int:
        """Announce again runs queued past ``threshold`` that have no outbox item."""
        params = {
            "environment": environment,
            "threshold_seconds": threshold.total_seconds(),
            "limit": limit,
        }
        return self._with_conn(
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

        return self._with_conn(status)

    def outbox_failing_queues(self, environment: str) -> list[FailingQueue]:
        """Per queue whose items failed to publish twice or more: how many, the most
        failures of one, the worst item's error and the oldest one's age."""
        params = {"environment": environment}

        def failing(conn: Conn) -> list[FailingQueue]:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["outbox_failing_queues"], params)
                return [FailingQueue(**row) for row in cur.fetchall()]

        return self._with_conn(failing)

    # -- consumers -----------------------------------------------------------------------

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
            "lock_scope": f"runlane:{self.schema}:{environment}",
            "worker_id": worker_id,
        }

        def claim(conn: Conn) -> list[ClaimedRun]:
            if concurrency_limit is None:
                return self._claimed_rows(
                    conn.execute(self._sql["run_claim_ids"], params).fetchall()
                )
            with conn.transaction():
                conn.execute(self._sql["queue_claim_lock"], params)
                return self._claimed_rows(
                    conn.execute(self._sql["run_claim_ids"], params).fetchall()
                )

        return self._with_conn(claim)

    def wal_flush(self) -> None:
        """Return once the WAL is flushed past every commit that returned before this call,
        asynchronous ones (a dedicated view's with ``synchronous_commit=False``) included.
        Needs a connection that commits synchronously (the pool's)."""
        self._with_conn(lambda conn: conn.execute(self._sql["wal_flush"]))

    def run_delivery_state(
        self, environment: str, run_ids: Sequence[uuid.UUID]
    ) -> dict[uuid.UUID, DeliveryState]:
        """Status, queue, dueness and queue pause of the named runs that exist."""
        if not run_ids:
            return {}
        params = {"environment": environment, "ids": list(run_ids)}
        return self._with_conn(
            lambda conn: {
                row[0]: DeliveryState(RunStatus(row[1]), row[2], bool(row[3]), bool(row[4]))
                for row in conn.execute(self._sql["run_delivery_state"], params)
            }
        )
