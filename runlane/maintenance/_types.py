"""Maintenance phases, per-pass limits and per-pass results."""

from __future__ import annotations

import enum

import attrs

from runlane.errors import ConfigurationError

__all__ = ["MaintenanceLimits", "MaintenancePhase", "MaintenanceResult"]


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


@attrs.frozen
class MaintenanceLimits:
    """How many records each phase may change in one pass. Zero skips that work."""

    due_delivery_limit: int = attrs.field(default=1000, validator=_non_negative)


@attrs.frozen
class MaintenanceResult:
    """The records one pass changed, per phase, for operational metrics."""

    due_runs_delivered: int = 0

    @property
    def total(self) -> int:
        return sum(attrs.astuple(self))
