"""Maintenance: the bounded passes that move due, deferred and interrupted work onward."""

from runlane.maintenance._pass import run_maintenance_pass
from runlane.maintenance._types import MaintenanceLimits, MaintenancePhase, MaintenanceResult

__all__ = ["MaintenanceLimits", "MaintenancePhase", "MaintenanceResult", "run_maintenance_pass"]
