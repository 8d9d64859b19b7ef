"""The runlane error hierarchy.

Every error raised on purpose by runlane derives from :class:`RunlaneError`. Where a built-in
exception has the same meaning, the runlane error also derives from it, so callers that
already catch ``ValueError`` or ``LookupError`` keep working.
"""

from __future__ import annotations

__all__ = [
    "ChildRunFailed",
    "ConfigurationError",
    "IncompatibleSchema",
    "NonRetryableError",
    "PayloadValidationError",
    "RunNotFound",
    "RunlaneError",
    "SchemaNotMigrated",
    "ServiceFailed",
    "StaleLease",
    "TaskNotFound",
    "WaitTokenNotFound",
    "WaitTokenTimedOut",
    "WorkerFailed",
]


class RunlaneError(Exception):
    """Base class of every error runlane raises on purpose."""


class ConfigurationError(RunlaneError, ValueError):
    """A definition or argument is invalid: fix the code that passed it."""


class PayloadValidationError(RunlaneError, ValueError):
    """A payload does not match its task's schema; nothing was written."""

    def __init__(self, task_id: str, problems: list[str]) -> None:
        self.task_id = task_id
        self.problems = problems
        listed = "; ".join(problems) if problems else "unknown problem"
        super().__init__(f"invalid payload for task {task_id!r}: {listed}")


class TaskNotFound(RunlaneError, LookupError):
    """A task id is not registered with this runtime."""


class RunNotFound(RunlaneError, LookupError):
    """No run with that id exists in this environment."""


class SchemaNotMigrated(RunlaneError):
    """The storage schema has not been installed: run the migration step first."""


class IncompatibleSchema(RunlaneError):
    """The storage schema was made by another or a newer version of runlane."""


class StaleLease(RunlaneError):
    """A fenced write lost: the attempt no longer holds the run's current lease."""


class WorkerFailed(RunlaneError):
    """A delivery worker slot failed for infrastructure reasons."""


class ServiceFailed(RunlaneError):
    """A maintenance service failed fatally."""


class WaitTokenNotFound(RunlaneError, LookupError):
    """No wait token with that id exists in this environment."""


class WaitTokenTimedOut(RunlaneError):
    """The awaited wait token timed out before anyone completed it."""

    def __init__(self, token_id: object, message: str) -> None:
        self.token_id = token_id
        super().__init__(message)


class ChildRunFailed(RunlaneError):
    """The awaited run ended failed or cancelled; ``status`` and ``error`` say how."""

    def __init__(self, run_id: object, status: str, error: object, message: str) -> None:
        self.run_id = run_id
        self.status = status
        self.error = error
        super().__init__(message)


class NonRetryableError(Exception):
    """Raise from a handler to fail the run at once, without further attempts.

    Deliberately not a :class:`RunlaneError`: it is raised by user code, not by runlane.
    """


for _cls in (
    RunlaneError,
    ConfigurationError,
    PayloadValidationError,
    TaskNotFound,
    RunNotFound,
    SchemaNotMigrated,
    IncompatibleSchema,
    StaleLease,
    WorkerFailed,
    ServiceFailed,
    WaitTokenNotFound,
    WaitTokenTimedOut,
    ChildRunFailed,
    NonRetryableError,
):
    _cls.__module__ = "runlane"
del _cls
