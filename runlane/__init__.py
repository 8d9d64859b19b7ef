"""runlane: durable task runs on PostgreSQL for synchronous, threaded Python."""

from runlane.context import RunContext
from runlane.errors import (
    ConfigurationError,
    IncompatibleSchema,
    NonRetryableError,
    PayloadValidationError,
    RunlaneError,
    RunNotFound,
    SchemaNotMigrated,
    ServiceFailed,
    StaleLease,
    TaskNotFound,
    WorkerFailed,
)
from runlane.maintenance import MaintenanceLimits, MaintenancePhase, MaintenanceResult
from runlane.models import DrainResult, RunError, RunHandle, RunSnapshot, RunStatus
from runlane.retry import RetryPolicy
from runlane.runtime import Runlane, create_runlane
from runlane.tasks import Queue, Task, queue, task

__all__ = [
    "ConfigurationError",
    "DrainResult",
    "IncompatibleSchema",
    "MaintenanceLimits",
    "MaintenancePhase",
    "MaintenanceResult",
    "NonRetryableError",
    "PayloadValidationError",
    "Queue",
    "RetryPolicy",
    "RunContext",
    "RunError",
    "RunHandle",
    "RunNotFound",
    "RunSnapshot",
    "RunStatus",
    "Runlane",
    "RunlaneError",
    "SchemaNotMigrated",
    "ServiceFailed",
    "StaleLease",
    "Task",
    "TaskNotFound",
    "WorkerFailed",
    "create_runlane",
    "queue",
    "task",
]
