"""One bounded maintenance pass over the phases this release implements."""

from __future__ import annotations

from runlane.maintenance._types import MaintenanceLimits, MaintenanceResult
from runlane.storage import Storage

__all__ = ["run_maintenance_pass"]


def run_maintenance_pass(
    storage: Storage, environment: str, limits: MaintenanceLimits
) -> MaintenanceResult:
    """Run each phase once within its limit.

    DUE_DELIVERY: retrying and released runs whose due time has passed (by database time)
    become ``queued``, so workers and drains can claim them.
    """
    delivered = (
        storage.run_deliver_due(environment, limits.due_delivery_limit)
        if limits.due_delivery_limit
        else 0
    )
    return MaintenanceResult(due_runs_delivered=delivered)
