"""What the publisher writes to the outbox, fenced by each item's claim token, and counts
(``PublisherStats``): claiming a page, extending claims before a chunk is published (an item
whose claim was lost is not published), and recording each result: published (deleted),
failed (released with a back-off), or released unpublished for a sweep. A write under a lost
claim changes nothing and is counted as stale."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol

import attrs

from runlane.errors import RunlaneError
from runlane.rabbitmq._amqp import name_too_long
from runlane.storage import OutboxItem

__all__ = ["Claimed", "OutboxRecords", "OutboxStorage", "PublisherStats"]


class OutboxStorage(Protocol):
    """The part of :class:`runlane.postgres.Outbox` a publisher uses."""

    def outbox_claim_page(
        self, environment: str, limit: int, claim: timedelta
    ) -> list[OutboxItem]: ...

    def outbox_extend(self, items: Sequence[OutboxItem], claim: timedelta) -> set[uuid.UUID]: ...

    def outbox_published(self, items: Sequence[OutboxItem]) -> set[uuid.UUID]: ...

    def outbox_failed(
        self, items: Sequence[OutboxItem], error: str, delay: timedelta
    ) -> set[uuid.UUID]: ...

    def outbox_unclaim(self, items: Sequence[OutboxItem]) -> set[uuid.UUID]: ...

    def outbox_next_due(self, environment: str) -> float | None: ...


log = logging.getLogger("runlane.rabbitmq.publisher")

# an item whose broker queue name is longer than AMQP allows (written by a producer that
# never checked it: an older runlane, a polling-lane runtime of the environment) is tried
# again this late, with that reason as its error: the broker is not asked and not blamed
_REFUSED_DELAY = 60.0
# what a claim must still have left, past one publish's timeout, for an item to be published
# under it: time to record the chunk's results (at most half of what the claim leaves past
# the publish timeout, so that a short claim still publishes)
_RECORD_ALLOWANCE = 5.0


@attrs.define
class PublisherStats:
    published: int = 0  # confirmed and recorded
    failed: int = 0  # not confirmed (broker down, unroutable, nacked); released to retry
    stale: int = 0  # results written under a lost claim: changed nothing
    unclaimed: int = 0  # not published under a claim about to expire: left to a sweep
    lost: int = 0  # not published: their claim was lost (expired or taken) before their chunk
    foreign: int = 0  # eager items of another environment: released, never published here


@attrs.frozen
class Claimed:
    """Items under a claim. ``deadline``: for a page this thread has just claimed, the
    monotonic time after which none of its first chunk is published; None for items
    claimed elsewhere (an eager trigger's), whose every chunk is extended first."""

    items: list[OutboxItem]
    deadline: float | None = None


class OutboxRecords:
    """The outbox writes of the publisher named ``name``. ``on_sweep`` asks its thread for
    a sweep (items were released, or their claims lost)."""

    def __init__(
        self,
        storage: OutboxStorage,
        name: str,
        *,
        schema: str,
        claim: timedelta,
        publish_timeout: float,
        on_sweep: Callable[[], None],
    ) -> None:
        self._storage = storage
        self.name = name
        self._schema = schema
        self._claim = claim
        self._on_sweep = on_sweep
        self.stats = PublisherStats()
        # a claim with less than this left publishes nothing more (see _publisher)
        self._margin = publish_timeout + min(
            _RECORD_ALLOWANCE, max(0.0, claim.total_seconds() - publish_timeout) / 2
        )

    def deadline_of(self, claimed_at: float) -> float:
        """The monotonic time after which nothing claimed at ``claimed_at`` is published."""
        return claimed_at + self._claim.total_seconds() - self._margin

    def claim_page(self, environment: str | None, limit: int) -> Claimed:
        if environment is None:  # not prepared yet: nothing of any environment is taken
            return Claimed([], time.monotonic())
        start = time.monotonic()  # the claims start after this
        items = self._storage.outbox_claim_page(environment, limit, self._claim)
        return Claimed(items, self.deadline_of(start))

    def next_due(self, environment: str) -> float | None:
        return self._storage.outbox_next_due(environment)

    def own(self, items: list[OutboxItem], environment: str | None) -> list[OutboxItem]:
        """The items of the environment served. Another environment's (never claimed by
        this publisher; an eager trigger of a storage shared across environments) are
        released at once for that environment's publishers, never published here: its
        runs may belong to a broker or virtual host this one may not use."""
        if environment is None:
            return items
        foreign = [item for item in items if item.environment != environment]
        if not foreign:
            return items
        self.stats.foreign += len(foreign)
        log.error(
            "runlane: %s publishes environment %r and was handed %d item(s) of another; "
            "released for that environment's publishers",
            self.name,
            environment,
            len(foreign),
        )
        try:
            self._storage.outbox_unclaim(foreign)
        except RunlaneError as exc:
            log.warning("runlane: %s could not release them (%s)", self.name, exc)
        return [item for item in items if item.environment == environment]

    def hold(self, items: list[OutboxItem]) -> tuple[list[OutboxItem], float] | None:
        """Extend the items' claims in database time, fenced by their tokens: the items
        still held and the monotonic time after which none of them is published; None when
        the database could not say (nothing is published: the claims expire and a sweep
        after a back-off takes them). Items whose claim was lost are dropped, and a sweep is
        asked for: a claim that expired unclaimed is taken afresh there."""
        start = time.monotonic()  # the extended claims start after this
        try:
            kept = self._storage.outbox_extend(items, self._claim)
        except RunlaneError as exc:
            log.warning(
                "runlane: %s could not extend the claims of %d item(s) (%s); they are "
                "published after their claims expire",
                self.name,
                len(items),
                exc,
            )
            return None
        held = [item for item in items if item.id in kept]
        lost = len(items) - len(held)
        if lost:
            self.stats.lost += lost
            log.info(
                "runlane: %s: %d item(s) had lost their claim before publishing; not published "
                "under it",
                self.name,
                lost,
            )
            self._on_sweep()
        return held, self.deadline_of(start)

    def refuse_unnameable(self, items: list[OutboxItem]) -> list[OutboxItem]:
        """The items whose broker queue can exist; the others are released for a late try
        with the reason, so they neither break the connection nor hold up the rest."""
        kept: list[OutboxItem] = []
        for item in items:
            problem = name_too_long(self._schema, item.environment, item.queue)
            if problem is None:
                kept.append(item)
                continue
            log.error("runlane: %s cannot publish run %s: %s", self.name, item.run_id, problem)
            self.record_failure([item], problem, _REFUSED_DELAY)
        return kept

    def record_success(self, items: list[OutboxItem]) -> int:
        if not items:
            return 0
        try:
            applied = self._storage.outbox_published(items)
        except RunlaneError as exc:
            log.warning(
                "runlane: %s published %d messages but could not record it (%s); their "
                "items are published again after their claims expire (consumers drop the "
                "duplicates)",
                self.name,
                len(items),
                exc,
            )
            return 0
        stale = len(items) - len(applied)
        self.stats.published += len(applied)
        if stale:
            self.stats.stale += stale
            log.warning(
                "runlane: %s: %d published item(s) had lost their claim; nothing recorded",
                self.name,
                stale,
            )
        return len(applied)

    def unclaim(
        self,
        items: list[OutboxItem],
        why: str = "the claim is about to expire before they are published",
    ) -> None:
        """Release items not published (their claim is about to expire, or they were not
        tried after a queue the broker could not serve), and sweep for them."""
        if not items:
            return
        self.stats.unclaimed += len(items)
        log.info("runlane: %s: %d item(s) released for a sweep: %s", self.name, len(items), why)
        try:
            self._storage.outbox_unclaim(items)
        except RunlaneError as exc:
            log.warning(
                "runlane: %s could not release %d item(s) (%s); they are published after "
                "their claims expire",
                self.name,
                len(items),
                exc,
            )
        self._on_sweep()

    def record_failure(self, items: list[OutboxItem], error: str, delay: float) -> None:
        self.stats.failed += len(items)
        try:
            applied = self._storage.outbox_failed(items, error, timedelta(seconds=delay))
        except RunlaneError as exc:
            log.warning(
                "runlane: %s could not release %d unpublished item(s) (%s); they are "
                "published after their claims expire",
                self.name,
                len(items),
                exc,
            )
            return
        stale = len(items) - len(applied)
        if stale:
            self.stats.stale += stale
