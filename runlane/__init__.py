"""runlane: durable task runs on PostgreSQL for synchronous, threaded Python."""

from runlane.context import RunContext
from runlane.errors import (
    ChildRunFailed,
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
    WaitTokenNotFound,
    WaitTokenTimedOut,
    WorkerFailed,
)
from runlane.maintenance import (
    MaintenanceLimits,
    MaintenancePhase,
    MaintenanceResult,
    RetentionPolicy,
    ServiceErrorInfo,
)
from runlane.maintenance._services import Services
from runlane.models import (
    CancelResult,
    DrainResult,
    RunError,
    RunHandle,
    RunSnapshot,
    RunStatus,
    StatusReport,
    WaitToken,
    WaitTokenStatus,
)
from runlane.retry import RetryPolicy
from runlane.runtime import Runlane, create_runlane
from runlane.schedules import Schedule, schedule
from runlane.tasks import Queue, Task, queue, task
from runlane.worker import Worker

__all__ = [
    "CancelResult",
    "ChildRunFailed",
    "ConfigurationError",
    "DrainResult",
    "IncompatibleSchema",
    "MaintenanceLimits",
    "MaintenancePhase",
    "MaintenanceResult",
    "NonRetryableError",
    "PayloadValidationError",
    "Queue",
    "RetentionPolicy",
    "RetryPolicy",
    "RunContext",
    "RunError",
    "RunHandle",
    "RunNotFound",
    "RunSnapshot",
    "RunStatus",
    "Runlane",
    "RunlaneError",
    "Schedule",
    "SchemaNotMigrated",
    "ServiceErrorInfo",
    "ServiceFailed",
    "Services",
    "StaleLease",
    "StatusReport",
    "Task",
    "TaskNotFound",
    "WaitToken",
    "WaitTokenNotFound",
    "WaitTokenStatus",
    "WaitTokenTimedOut",
    "Worker",
    "WorkerFailed",
    "create_runlane",
    "queue",
    "schedule",
    "task",
]
