"""A transport lane's trigger path: runs inserted with the outbox items of those due now
already claimed, handed to the lane's :class:`EagerPublisher` once committed (a producer
that dies first leaves them to be published once their claim expires). Statements:
``run_insert_many_claimed`` (``sql/runs.sql``), ``run_insert_group_claimed*``
(``sql/group.sql``); the items are written by migration 3's triggers.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Protocol

import psycopg

from runlane.postgres._batches import pipelined, refusing_too_large, split_runs
from runlane.postgres._connections import Conn
from runlane.postgres._executor import Executor
from runlane.postgres._group import GroupCommit, group_row, group_rows
from runlane.postgres._inserts import group_handles, insert_params, resolved
from runlane.storage import InsertedRun, NewRuns, OutboxItem

__all__ = ["EagerInserts", "EagerPublisher", "eager_item_id"]


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


def eager_item_id(claim: uuid.UUID, run_id: uuid.UUID) -> uuid.UUID:
    """The id the insert trigger gives an eagerly claimed item: md5(claim || run id)."""
    return uuid.UUID(hashlib.md5(f"{claim}{run_id}".encode(), usedforsecurity=False).hexdigest())


class EagerInserts:
    """The eager inserts of one storage view; ``group`` shares statements between
    concurrent lone calls, ``insert`` writes a call that cannot share."""

    def __init__(self, db: Executor, publisher: EagerPublisher) -> None:
        self._db = db
        self.publisher = publisher
        self.group = GroupCommit(self.insert_alone, self.insert_together)

    def insert(self, runs: NewRuns) -> list[InsertedRun]:
        """A call of its own, through a cursor, split as _batches says."""
        claim = uuid.uuid4()
        pieces = split_runs(runs)
        claimed_at = time.monotonic()  # before the statement: the claim starts after
        sql = self._db.sql

        def insert(conn: Conn) -> tuple[list[InsertedRun], list[uuid.UUID]]:
            params = [{**insert_params(piece), "claim": str(claim)} for piece in pieces]
            rows = pipelined(conn, sql["run_insert_many_claimed"], params)
            made = resolved(conn, sql["run_find_existing"], runs, {row[0] for row in rows})
            return made, [row[0] for row in rows if row[1]]

        made, due_now = self._db.run(lambda conn: refusing_too_large(insert, conn, runs))
        if due_now:
            self.publisher.submit(
                [
                    OutboxItem(eager_item_id(claim, r), r, runs.environment, runs.queue, claim)
                    for r in due_now
                ],
                claimed_at,
            )
        return made

    def insert_alone(self, runs: NewRuns) -> list[InsertedRun]:
        """One groupable call by itself (a lone caller, or a call of a group that failed):
        the shared claimed statement with one row, through libpq (postgres/_pq.py), which
        measured cheaper for the client and the server alike than ``insert``'s
        run_insert_many_claimed through a cursor (benchmarks/README.md, session 6)."""
        return self.insert_together([runs])[0]

    def insert_together(
        self,
        groups: Sequence[NewRuns],
        rows: str | None = None,
        committed: Callable[[], None] | None = None,
    ) -> list[list[InsertedRun]]:
        """The calls' runs in one statement and one commit (_group), their due items under
        one claim and handed to the publisher at once; each call's handles, in order.
        ``rows`` and ``committed`` as for RunRepository.insert_together."""
        claim = uuid.uuid4()
        if rows is None:
            rows = group_rows([group_row(r) for r in groups])
        params = {"rows": rows, "claim": str(claim)}
        claimed_at = time.monotonic()  # before the statement: the claim starts after
        keyed = any(key is not None for runs in groups for key in runs.idempotency_keys)
        statement = self._db.raw[
            "run_insert_group_claimed" if keyed else "run_insert_group_claimed_fresh"
        ]
        find = self._db.sql["run_find_existing"]

        def insert(conn: Conn) -> tuple[list[list[InsertedRun]], list[uuid.UUID]]:
            try:
                rows = [
                    (uuid.UUID(row[0]), row[1] == "t")
                    for row in statement.rows(conn, params)
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
            made = group_handles(conn, find, groups, {row[0] for row in rows})
            return made, [run_id for run_id, due_now in rows if due_now]

        if len(groups) == 1:  # a call alone: its payload refused as too large, if it is
            made, due_now = self._db.run(lambda conn: refusing_too_large(insert, conn, groups[0]))
        else:
            made, due_now = self._db.run(insert)
        if due_now:
            where = {i: runs for runs in groups for i in runs.ids}
            self.publisher.submit(
                [
                    OutboxItem(
                        eager_item_id(claim, r), r, where[r].environment, where[r].queue, claim
                    )
                    for r in due_now
                ],
                claimed_at,
            )
        return made
