"""Maintenance: the bounded passes that move due, deferred and interrupted work onward.

``Runlane.run_maintenance_once`` runs one pass; ``Runlane.start_services`` returns the
:class:`Services` running them as supervised loops.
"""

from runlane.maintenance._services import Services
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
    "NOT_RECORDS",
    "LaneMaintenance",
    "MaintenanceLimits",
    "MaintenancePhase",
    "MaintenanceResult",
    "RetentionPolicy",
    "ServiceErrorInfo",
    "Services",
]
