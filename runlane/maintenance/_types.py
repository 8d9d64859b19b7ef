"""Maintenance phases, per-pass limits, per-pass results and the retention policy."""

from __future__ import annotations

import enum
from collections.abc import Callable
from datetime import timedelta

import attrs

from runlane.toolkit import MAX_DURATION, as_int32, as_timedelta

__all__ = [
    "NOT_RECORDS",
    "LaneMaintenance",
    "MaintenanceLimits",
    "MaintenancePhase",
    "MaintenanceResult",
    "RetentionPolicy",
    "ServiceErrorInfo",
]


class MaintenancePhase(enum.StrEnum):
    """The phases of one maintenance pass, in the order a pass runs them."""

    SCHEDULES = "schedules"
    DUE_DELIVERY = "due_delivery"
    WAIT_TOKEN_RESOLUTION = "wait_token_resolution"
    ATTEMPT_EXPIRY = "attempt_expiry"
    DELIVERY_RECOVERY = "delivery_recovery"
    CLEANUP = "cleanup"
    STATS = "stats"  # the per-minute rollup: fold recent minutes, prune past retention


def _count(minimum: int) -> Callable[[object, attrs.Attribute[int], int], None]:
    def check(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
        # at most what an integer column counts: a limit is bound as a query parameter,
        # and 10**20 failed every pass with "bigint out of range"
        as_int32(f"MaintenanceLimits.{attribute.name}", value, minimum)

    return check


_non_negative = _count(0)
_positive = _count(1)


def _limit(default: int) -> int:
    return attrs.field(default=default, validator=_non_negative)


@attrs.frozen
class MaintenanceLimits:
    """How many records each phase may change in one pass. Zero skips that work."""

    schedule_limit: int = _limit(100)
    due_delivery_limit: int = _limit(1000)
    wait_token_timeout_limit: int = _limit(100)
    wait_token_resume_limit: int = _limit(100)
    attempt_expiry_limit: int = _limit(1000)
    delivery_recovery_limit: int = _limit(100)
    cleanup_limit: int = _limit(1000)
    # minutes of the rollup one pass recomputes at most (a fold behind catches up this fast)
    stats_minutes: int = _limit(60)
    # transport lanes: outbox items one pass publishes (at least 1)
    outbox_publish_limit: int = attrs.field(default=100, validator=_positive)


# metadata of a LaneMaintenance field that counts notifications, not records changed
NOT_RECORDS = {"record": False}


@attrs.frozen
class LaneMaintenance:
    """What a lane's part of ``DELIVERY_RECOVERY`` did (``Lane.recover_delivery`` returns
    it; ``MaintenanceResult.lane`` carries it). Every field is a count.

    The fields are those the shipped lanes report, which SPEC names on every result: the
    polling lane's ``queues_woken`` (announcements, not records) and a transport lane's
    ``outbox_published`` and ``deliveries_recovered``. A lane with counts of its own
    subclasses it as a frozen attrs class of ``int`` fields; a field that counts
    notifications rather than records changed carries ``metadata=NOT_RECORDS`` and stays
    out of ``MaintenanceResult.total``.
    """

    queues_woken: int = attrs.field(default=0, metadata=NOT_RECORDS)  # queues announced again
    outbox_published: int = 0  # transport lanes: outbox items published by the pass
    deliveries_recovered: int = 0  # runs re-announced: queued too long without an item

    @property
    def records(self) -> int:
        """Records changed (every field but those marked ``NOT_RECORDS``)."""
        return sum(
            getattr(self, a.name) for a in attrs.fields(type(self)) if a.metadata != NOT_RECORDS
        )

    def counts(self) -> dict[str, int]:
        """Every field by name."""
        return {a.name: getattr(self, a.name) for a in attrs.fields(type(self))}

    def __add__(self, other: LaneMaintenance) -> LaneMaintenance:
        """Field by field; an empty base result adds to any lane's."""
        if type(other) is not type(self):
            if other == LaneMaintenance():
                return self
            if self == LaneMaintenance():
                return other
            raise TypeError(
                f"cannot add {type(self).__name__} and {type(other).__name__}: "
                "results of different lanes"
            )
        return attrs.evolve(
            self, **{name: n + getattr(other, name) for name, n in self.counts().items()}
        )


@attrs.frozen
class MaintenanceResult:
    """The records one pass changed, per phase, for operational metrics. The lane's part
    of ``DELIVERY_RECOVERY`` is ``lane`` (its counts are also readable here:
    ``queues_woken``, ``outbox_published``, ``deliveries_recovered``)."""

    schedules_created: int = 0
    due_runs_delivered: int = 0
    wait_tokens_timed_out: int = 0
    wait_token_runs_resumed: int = 0
    attempts_expired: int = 0
    cancellations_finalized: int = 0
    runs_pruned: int = 0
    runs_tombstoned: int = 0
    workers_pruned: int = 0  # rows of stopped and lost workers past their retention
    audit_pruned: int = 0  # records of the operators' audit trail past their retention
    stats_pruned: int = 0  # rows of the per-minute rollup past their retention
    lane: LaneMaintenance = LaneMaintenance()  # what the lane's delivery recovery did

    @property
    def queues_woken(self) -> int:
        """Queues announced again by the polling lane (``lane.queues_woken``)."""
        return self.lane.queues_woken

    @property
    def outbox_published(self) -> int:
        """Outbox items a transport lane published in the pass (``lane.outbox_published``)."""
        return self.lane.outbox_published

    @property
    def deliveries_recovered(self) -> int:
        """Runs re-announced after being queued too long without an outbox item
        (``lane.deliveries_recovered``)."""
        return self.lane.deliveries_recovered

    def _engine(self) -> dict[str, int]:
        return attrs.asdict(self, recurse=False, filter=lambda a, _: a.name != "lane")

    def counts(self) -> dict[str, int]:
        """Every count by name, the lane's included, flat (for logs and metrics)."""
        return {**self._engine(), **self.lane.counts()}

    @property
    def total(self) -> int:
        """Records changed in all phases (wake-up notifications are not records)."""
        return sum(self._engine().values()) + self.lane.records

    def __add__(self, other: MaintenanceResult) -> MaintenanceResult:
        theirs = other._engine()
        return MaintenanceResult(
            **{name: n + theirs[name] for name, n in self._engine().items()},
            lane=self.lane + other.lane,
        )


def _retention(instance: object, attribute: attrs.Attribute[timedelta], value: timedelta) -> None:
    # cleanup compares finished_at with now() - retention: past 100 years that date leaves
    # what Postgres holds, and every cleanup pass failed
    as_timedelta(f"RetentionPolicy.{attribute.name}", value, timedelta(0), MAX_DURATION)


@attrs.frozen
class RetentionPolicy:
    """How long terminal runs are kept before cleanup prunes them, and how long the rows of
    stopped and lost workers are (``workers``, from their last heartbeat: an attempt's host
    is shown while its worker's row is kept, so the default matches ``completed``), and the
    rows of the per-minute rollup ``Runlane.stats`` reads (``stats``, from their minute)."""

    completed: timedelta = attrs.field(default=timedelta(days=7), validator=_retention)
    failed: timedelta = attrs.field(default=timedelta(days=30), validator=_retention)
    cancelled: timedelta = attrs.field(default=timedelta(days=30), validator=_retention)
    workers: timedelta = attrs.field(default=timedelta(days=7), validator=_retention)
    # the operators' audit trail (``Runlane.list_audit``), from each record's time
    audit: timedelta = attrs.field(default=timedelta(days=365), validator=_retention)
    stats: timedelta = attrs.field(default=timedelta(days=30), validator=_retention)


@attrs.frozen
class ServiceErrorInfo:
    """What ``on_service_error`` learns about a failed pass or lease operation."""

    phase: MaintenancePhase
    band: str
    operation: str  # "pass", "acquire", "refresh" or "release"
