"""Maintenance phases, per-pass limits, per-pass results and the retention policy."""

from __future__ import annotations

import enum
from datetime import timedelta

import attrs

from runlane.errors import ConfigurationError

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


def _non_negative(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            f"MaintenanceLimits.{attribute.name} must be a non-negative integer, got {value!r}"
        )


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"MaintenanceLimits.{attribute.name} must be a positive integer, got {value!r}"
        )


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
    if not isinstance(value, timedelta) or value < timedelta(0):
        raise ConfigurationError(
            f"RetentionPolicy.{attribute.name} must be a non-negative timedelta, got {value!r}"
        )


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
