"""The transport toolkit: what a lane that delivers through another system (the RabbitMQ
lane, or one kept outside this package) builds on: the Postgres storage seen as an
:class:`Outbox` (``outbox_of``), an :class:`EagerPublisher`, and the announcement listener
and run-end watcher of ``runlane.postgres``. docs/lanes.md, "Writing a transport lane",
says how they fit together.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

from runlane.errors import ConfigurationError
from runlane.postgres._eager import EagerPublisher
from runlane.postgres._storage import PostgresStorage
from runlane.storage import (
    ClaimedRun,
    DeliveryState,
    FailingQueue,
    LimitedClaim,
    OutboxItem,
    OutboxStatus,
    QueueLimits,
    Storage,
)

__all__ = ["EagerPublisher", "Outbox", "outbox_of"]


class Outbox(Protocol):
    """A Postgres storage's outbox and by-id claims, as a transport lane uses them.

    Every method raises :class:`~runlane.StorageUnavailable` when the database cannot be
    reached and :class:`~runlane.RunlaneError` for any other database error; no driver
    exception leaves it. Results are fenced: a write presenting an item's ``claim_token``
    applies only while that claim is the item's current one, and returns the ids applied.
    """

    def outbox_enable(self, environment: str, claim: timedelta) -> None:
        """Runs of ``environment`` becoming queued get outbox items from now on; an eager
        trigger's items are claimed for ``claim``. Idempotent; call it in ``Lane.prepare``."""

    def attach_eager_publisher(self, publisher: EagerPublisher) -> None:
        """Triggers without ``connection=`` store their items due now already claimed and
        hand them to ``publisher`` after commit; ``trigger(connection=...)`` stores them
        unclaimed and its commit sends ``outbox|<queue>``. Closing the storage closes the
        publisher; dedicated views share it. Call it in ``Lane.create_storage``."""

    @property
    def eager_publisher(self) -> EagerPublisher | None:
        """The publisher attached with :meth:`attach_eager_publisher`, if any."""

    def outbox_claim_page(self, environment: str, limit: int, claim: timedelta) -> list[OutboxItem]:
        """Claim up to ``limit`` publishable items of ``environment`` (never another
        environment's: its items may belong to a broker or virtual host this publisher may
        not use), each under a fresh token that expires ``claim`` after database now (an
        expired claim may be taken again by any publisher of the environment)."""

    def outbox_extend(self, items: Sequence[OutboxItem], claim: timedelta) -> set[uuid.UUID]:
        """Before publishing items under their claim: extend it to ``claim`` after database
        now for those whose claim is still theirs and unexpired, and return their ids; the
        others lost their claim (it expired, or another publisher took them) and must not
        be published under it."""

    def outbox_published(self, items: Sequence[OutboxItem]) -> set[uuid.UUID]:
        """Delete the items whose claim is still theirs (published and confirmed)."""

    def outbox_failed(
        self, items: Sequence[OutboxItem], error: str, delay: timedelta
    ) -> set[uuid.UUID]:
        """Release the items whose claim is still theirs for a try after ``delay``,
        recording ``error`` (counted per item: ``outbox_failing_queues``)."""

    def outbox_unclaim(self, items: Sequence[OutboxItem]) -> set[uuid.UUID]:
        """Give up the claim on the items still under it, for another claim now (not a
        failure: e.g. too little of the claim was left to publish under it)."""

    def outbox_next_due(self, environment: str) -> float | None:
        """Seconds until the next item of ``environment`` becomes publishable (<= 0: now),
        None when none: unclaimed items when available, claimed ones when their claim
        expires (a producer that died after an eager trigger)."""

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
        """Claim the named runs that are queued and due, with the polling lane's fenced
        claim; for a bounded ``queue`` (all ids of that queue) at most what its
        ``concurrency_limit`` leaves, under the queue's claim lock."""

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
    ) -> LimitedClaim:
        """Claim from a queue with a rate or per-key limit; with ``run_ids`` only those
        runs, when queued and due (see :meth:`runlane.storage.Storage.run_claim_limited`)."""

    def run_delivery_state(
        self, environment: str, run_ids: Sequence[uuid.UUID]
    ) -> dict[uuid.UUID, DeliveryState]:
        """Why named runs that exist were not claimed: status, queue, due, queue paused."""

    def outbox_defer(self, environment: str, run_ids: Sequence[uuid.UUID], delay: timedelta) -> int:
        """Publish the still-queued runs again after ``delay`` (or their due time, if later):
        a delivery that could not be claimed yet (not due, its queue at capacity)."""

    def wal_flush(self) -> None:
        """Return once the WAL is flushed past every commit that returned before this call,
        on any connection (a dedicated view's asynchronous claims included): one short
        transaction that commits synchronously. A consumer whose claims commit
        asynchronously acknowledges their deliveries only after it, so a server crash that
        loses a claim leaves its message unacknowledged and delivered again."""

    def outbox_recover(self, environment: str, threshold: timedelta, limit: int) -> int:
        """Write items again for up to ``limit`` runs queued past ``threshold`` with none
        (a purged broker queue, a dead-lettered message); returns how many."""

    def outbox_status(self, environment: str) -> OutboxStatus:
        """Pending items of ``environment`` and the oldest one's age (database time)."""

    def outbox_failing_queues(self, environment: str) -> list[FailingQueue]:
        """Per queue whose items failed to publish twice or more (the transport cannot
        serve it): how many, the most failures of one, the worst item's error, the oldest
        one's age."""

    def dedicated(self, name: str, *, durable_commits: bool = True) -> Outbox:
        """A view on one connection of its own, for one thread (a consumer's claims)."""

    def interrupt(self) -> None:
        """Cancel the statement in flight on a dedicated view (from another thread)."""

    def close(self, timeout: float | None = None) -> None: ...


def outbox_of(storage: Storage) -> Outbox:
    """``storage`` as an :class:`Outbox`: the storage the lane's ``create_storage`` made,
    which the engine hands back to every lane method. Raises
    :class:`~runlane.ConfigurationError` for a storage that keeps no outbox (not a
    :class:`~runlane.postgres.PostgresStorage`)."""
    if not isinstance(storage, PostgresStorage):
        raise ConfigurationError(
            f"a transport lane keeps its runs in the Postgres storage (runlane.postgres."
            f"PostgresStorage), got {type(storage).__name__}: return a PostgresStorage from "
            "the lane's create_storage()"
        )
    return storage
