"""Maintenance phases, per-pass limits, per-pass results and the retention policy."""

from __future__ import annotations

import enum
from collections.abc import Callable
from datetime import timedelta

import attrs

from runlane._limits import MAX_DURATION, as_int32, as_timedelta

__all__ = [
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
    # transport lanes: outbox items one pass publishes (at least 1)
    outbox_publish_limit: int = attrs.field(default=100, validator=_positive)


@attrs.frozen
class MaintenanceResult:
    """The records one pass changed, per phase, for operational metrics."""

    schedules_created: int = 0
    due_runs_delivered: int = 0
    wait_tokens_timed_out: int = 0
    wait_token_runs_resumed: int = 0
    attempts_expired: int = 0
    cancellations_finalized: int = 0
    queues_woken: int = 0
    runs_pruned: int = 0
    runs_tombstoned: int = 0
    outbox_published: int = 0  # transport lanes: outbox items published by the pass
    deliveries_recovered: int = 0  # runs re-announced: queued too long without an item
    workers_pruned: int = 0  # rows of stopped and lost workers past their retention

    @property
    def total(self) -> int:
        """Records changed in all phases (wake-up notifications are not records)."""
        changed: int = sum(attrs.astuple(self)) - self.queues_woken
        return changed

    def __add__(self, other: MaintenanceResult) -> MaintenanceResult:
        return MaintenanceResult(
            *(a + b for a, b in zip(attrs.astuple(self), attrs.astuple(other), strict=True))
        )


def _retention(instance: object, attribute: attrs.Attribute[timedelta], value: timedelta) -> None:
    # cleanup compares finished_at with now() - retention: past 100 years that date leaves
    # what Postgres holds, and every cleanup pass failed
    as_timedelta(f"RetentionPolicy.{attribute.name}", value, timedelta(0), MAX_DURATION)


@attrs.frozen
class RetentionPolicy:
    """How long terminal runs are kept before cleanup prunes them, and how long the rows of
    stopped and lost workers are (``workers``, from their last heartbeat: an attempt's host
    is shown while its worker's row is kept, so the default matches ``completed``)."""

    completed: timedelta = attrs.field(default=timedelta(days=7), validator=_retention)
    failed: timedelta = attrs.field(default=timedelta(days=30), validator=_retention)
    cancelled: timedelta = attrs.field(default=timedelta(days=30), validator=_retention)
    workers: timedelta = attrs.field(default=timedelta(days=7), validator=_retention)


@attrs.frozen
class ServiceErrorInfo:
    """What ``on_service_error`` learns about a failed pass or lease operation."""

    phase: MaintenancePhase
    band: str
    operation: str  # "pass", "acquire", "refresh" or "release"
