"""Maintenance: the bounded passes that move due, deferred and interrupted work onward."""

from runlane.maintenance._pass import (
    MaintenanceScope,
    ScheduleEntry,
    run_maintenance_pass,
    run_phase,
)
from runlane.maintenance._types import (
    MaintenanceLimits,
    MaintenancePhase,
    MaintenanceResult,
    RetentionPolicy,
    ServiceErrorInfo,
)

__all__ = [
    "MaintenanceLimits",
    "MaintenancePhase",
    "MaintenanceResult",
    "MaintenanceScope",
    "RetentionPolicy",
    "ScheduleEntry",
    "ServiceErrorInfo",
    "run_maintenance_pass",
    "run_phase",
]
