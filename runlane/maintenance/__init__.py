"""Maintenance: the bounded passes that move due, deferred and interrupted work onward.

``Runlane.run_maintenance_once`` runs one pass (``run_maintenance_pass`` over a
``MaintenanceScope``); ``Runlane.start_services`` returns the :class:`Services` running them
as supervised loops, one per band of ``BANDS``.
"""

from runlane.maintenance._board import ServiceErrorCallback
from runlane.maintenance._pass import MaintenanceScope, ScheduleEntry, run_maintenance_pass
from runlane.maintenance._services import BANDS, Services
from runlane.maintenance._types import (
    NOT_RECORDS,
    LaneMaintenance,
    MaintenanceLimits,
    MaintenancePhase,
    MaintenanceResult,
    RetentionPolicy,
    ServiceErrorInfo,
)

__all__ = [
    "BANDS",
    "NOT_RECORDS",
    "LaneMaintenance",
    "MaintenanceLimits",
    "MaintenancePhase",
    "MaintenanceResult",
    "MaintenanceScope",
    "RetentionPolicy",
    "ScheduleEntry",
    "ServiceErrorCallback",
    "ServiceErrorInfo",
    "Services",
    "run_maintenance_pass",
]
