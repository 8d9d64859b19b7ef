"""The runlane error hierarchy.

Every error raised on purpose by runlane derives from :class:`RunlaneError`. Where a built-in
exception has the same meaning, the runlane error also derives from it, so callers that
already catch ``ValueError`` or ``LookupError`` keep working.
"""

from __future__ import annotations

import enum

__all__ = [
    "ChildRunFailed",
    "ConfigurationError",
    "IncompatibleSchema",
    "LeaseExpired",
    "NonRetryableError",
    "PayloadValidationError",
    "RunInterrupted",
    "RunNotFound",
    "RunStateConflict",
    "RunlaneClosed",
    "RunlaneError",
    "SchemaNotMigrated",
    "ServiceFailed",
    "StaleLease",
    "StopReason",
    "StorageUnavailable",
    "TaskNotFound",
    "TaskTimeout",
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


class RunlaneClosed(RunlaneError):
    """The runtime was closed: call ``start()`` to open it again, or build a new one."""


class StorageUnavailable(RunlaneError):
    """The database refused, timed out or broke the connection and retries are spent.

    The message names the host and port (never the password) and what to check.
    ``transient`` is True when waiting may fix it: the server is restarting, starting up,
    refusing connections or out of connection slots, or dropped the connection (what a
    service's ``wait_for_database`` waits out); False when no wait can (a host name that
    does not resolve, a refused password, a missing database) or runlane cannot tell.
    """

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class RunStateConflict(RunlaneError):
    """The run is not in a status that allows the operation; the message says which."""


class StopReason(enum.Enum):
    """Why a handler was asked to stop (``RunContext.stop_reason``)."""

    CANCEL_REQUESTED = "cancel_requested"
    SHUTDOWN = "shutdown"
    LEASE_LOST = "lease_lost"
    TIMEOUT = "timeout"


class RunInterrupted(RunlaneError):
    """Raised by ``context.raise_if_stopped()``: the handler was asked to stop.

    Let it propagate: the engine records it by ``reason`` (shutdown hands the run back with
    its attempt unspent, cancel ends it ``cancelled``, timeout fails the attempt, a lost
    lease writes nothing).
    """

    def __init__(self, reason: StopReason, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class TaskTimeout(RunlaneError):
    """Stored on a run: an attempt ran past its task's timeout (retried per its policy)."""


class LeaseExpired(RunlaneError):
    """Stored on a run: an attempt's lease lapsed (its worker crashed, froze or lost its
    connection) and maintenance finalized it (retried per its task's policy)."""


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
    RunlaneClosed,
    StorageUnavailable,
    RunStateConflict,
    StopReason,
    RunInterrupted,
    TaskTimeout,
    LeaseExpired,
):
    _cls.__module__ = "runlane"
del _cls
