"""Records the runtime hands back to callers: run status, snapshots, handles, drain results."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Any, Generic, TypeVar

import attrs

from runlane.flow import RateLimit

__all__ = [
    "AttemptRecord",
    "AuditRecord",
    "BulkResult",
    "CancelResult",
    "DrainResult",
    "LaneStatus",
    "MaintenanceLeaseStatus",
    "Page",
    "QueueInfo",
    "QueueStatus",
    "ResolvedTokenStatus",
    "RunError",
    "RunHandle",
    "RunHistory",
    "RunPage",
    "RunSnapshot",
    "RunStatus",
    "ScheduleInfo",
    "StatusReport",
    "StepRecord",
    "WaitToken",
    "WaitTokenStatus",
    "WorkerInfo",
    "WorkerState",
]


class RunStatus(enum.StrEnum):
    """Where a run is in its lifecycle (see docs/architecture.md for the state machine)."""

    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    RELEASED = "released"
    WAITING = "waiting"
    CANCELLATION_REQUESTED = "cancellation_requested"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED})


@attrs.frozen
class RunError:
    """What an attempt's failure left behind: exception type, message and traceback."""

    type: str
    message: str
    traceback: str | None = None
    retryable: bool = True


@attrs.frozen
class RunHandle:
    """The answer to a trigger: the run's id and whether this call created it.

    ``created`` is false when an idempotency key matched a run triggered earlier.
    """

    id: uuid.UUID
    task_id: str
    queue: str
    created: bool = True


@attrs.frozen
class RunSnapshot:
    """A point-in-time read of one run."""

    id: uuid.UUID
    environment: str
    task_id: str
    queue: str
    status: RunStatus
    # the number of the latest attempt started (1, 2, ...; 0 before the first claim). Numbers
    # only grow: an attempt handed back unspent (worker shutdown, context.release, a durable
    # wait) and an operator's retry_run take the next number too, so it is not a count of
    # failures; attempts_spent is
    attempt: int
    # attempts counted against max_attempts: started, minus those handed back unspent, since
    # the run was triggered or last retried by an operator (retry_run grants a fresh budget).
    # max_attempts - attempts_spent more may start (docs/architecture.md, "Counting attempts")
    attempts_spent: int
    max_attempts: int
    priority: int
    payload: Any
    output: Any
    error: RunError | None
    idempotency_key: str | None
    parent_run_id: uuid.UUID | None
    created_at: datetime
    updated_at: datetime
    due_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    # the last ``context.report_progress``: {"fraction": ..., "message": ..., "data": ...}
    progress: Any = None
    # running or cancellation_requested, and the current attempt's handler has started (a
    # worker records a start within about a second, handlers that end sooner not at all);
    # False for a run only claimed: prefetched by a worker, or between its claim and start
    executing: bool = False

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal

    @property
    def claimed_not_started(self) -> bool:
        """Holds a lease (``running``) but its handler has not been seen to start."""
        return self.status is RunStatus.RUNNING and not self.executing


@attrs.frozen
class RunPage:
    """One page of ``Runlane.list_runs``: runs newest first (by creation time, then id).

    ``next_cursor`` is an opaque string to pass as ``cursor=`` for the next (older) page, or
    None when this page holds the last matching run. ``searched_to`` is set when a search
    (a prefix, key or payload filter) ran out of its time budget: it looked at runs created
    down to that time, and ``next_cursor`` continues from there."""

    runs: tuple[RunSnapshot, ...]
    next_cursor: str | None
    searched_to: datetime | None = None


@attrs.frozen
class AttemptRecord:
    """One finished attempt of a run, as kept in its history.

    ``outcome`` is what the attempt ended as: ``completed``, ``failed``, ``retrying`` (failed,
    another attempt followed), ``released`` (handed back unconsumed), ``suspended`` (the run
    went waiting), ``cancelled`` or ``expired`` (its lease lapsed)."""

    number: int
    outcome: str
    error: RunError | None
    started_at: datetime
    finished_at: datetime
    worker_id: uuid.UUID | None = None  # the delivery worker that ran it (None: unknown)
    host: str | None = None  # that worker's host, while its row is kept


@attrs.frozen
class StepRecord:
    """A durable step's stored output (``context.step``) and when it was stored."""

    name: str
    output: Any
    created_at: datetime
    attempt: int  # the attempt that stored it


@attrs.frozen
class RunHistory:
    """``Runlane.get_run_history``: the run now, its finished attempts in order, and its
    stored steps in the order they were stored. An attempt still running is not listed
    (``run.attempt`` is its number)."""

    run: RunSnapshot
    attempts: tuple[AttemptRecord, ...]
    steps: tuple[StepRecord, ...]


class WaitTokenStatus(enum.StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    TIMED_OUT = "timed_out"


@attrs.frozen
class WaitToken:
    """A point-in-time read of a wait token. ``waiting_runs`` counts runs suspended on it."""

    id: uuid.UUID
    status: WaitTokenStatus
    output: Any
    idempotency_key: str | None
    timeout_at: datetime | None
    created_at: datetime
    resolved_at: datetime | None
    waiting_runs: int


@attrs.frozen
class CancelResult:
    """What ``Runlane.cancel`` did. ``changed`` is False when the run was already terminal or
    its cancellation was already requested; ``status`` is where the run stands now."""

    run_id: uuid.UUID
    previous: RunStatus
    status: RunStatus
    changed: bool


@attrs.frozen
class DrainResult:
    """What one :meth:`Runlane.drain` call did."""

    runs_executed: int
    completed: int = 0  # attempts that completed their run
    failed: int = 0  # attempts that failed their run for good
    retried: int = 0  # failed attempts whose run was scheduled to retry


@attrs.frozen
class MaintenanceLeaseStatus:
    band: str
    owner: uuid.UUID
    fencing: int
    expires_at: datetime
    live: bool


@attrs.frozen
class ResolvedTokenStatus:
    """A resolved wait token whose runs are still waiting (``StatusReport.resolved_tokens``):
    ``waiting_runs`` should fall from one look to the next while maintenance resumes them."""

    token_id: uuid.UUID
    waiting_runs: int
    resolved_age_seconds: float  # since the token completed or timed out (database time)


@attrs.frozen
class QueueStatus:
    """One queue's runs in ``StatusReport.queues``. ``running`` counts the runs whose
    current attempt's handler has started (``RunSnapshot.executing``) and those being
    cancelled (``cancellation_requested``); ``claimed`` the runs a worker holds whose handler
    has not been seen to start (claimed ahead of a free slot, or started under a second ago:
    ``RunSnapshot.claimed_not_started``), so ``running + claimed`` are the runs holding an
    attempt. ``retrying`` counts retrying and released runs, ``live_leases`` attempts holding
    a lease that has not lapsed (what ``concurrency_limit``, None for an unbounded queue,
    caps)."""

    name: str
    queued: int
    running: int
    retrying: int
    waiting: int
    live_leases: int
    concurrency_limit: int | None
    paused: bool = False  # Runlane.pause_queue: its runs are not claimed until resumed
    claimed: int = 0  # claimed, handler not started; not part of running


# pending outbox items older than this mean nothing is publishing them (LaneStatus.problems)
OUTBOX_MAX_AGE_SECONDS = 60.0


@attrs.frozen
class LaneStatus:
    """A lane's own part of a :class:`StatusReport` (``StatusReport.lane``), which
    ``Lane.status`` returns.

    The engine reads only what this class declares: ``problems()`` (lines added to the
    unhealthy checks of ``runlane status``, the console and ``--json``), ``rows()`` (lines
    shown after the engine's) and the outbox counts, which SPEC names on every report. A
    lane with more to say subclasses it as a frozen attrs class (the RabbitMQ lane's
    ``RabbitMQStatus`` adds its broker) and overrides both methods to show it.
    """

    # items written but not yet handed to the transport (0 for a lane without an outbox,
    # None when the lane does not say)
    outbox_pending: int | None = None
    outbox_oldest_age_seconds: float | None = None  # age of the oldest pending item

    def problems(self) -> list[str]:
        """One line per failing lane check, naming what is wrong and what to do."""
        age = self.outbox_oldest_age_seconds
        if age is not None and age > OUTBOX_MAX_AGE_SECONDS:
            return [
                f"the oldest pending outbox item is {age:.0f}s old (is a publisher running, "
                "and can it reach the transport?)"
            ]
        return []

    def rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` lines the status output shows for this lane, after the
        outbox's."""
        return []


@attrs.frozen
class StatusReport:
    """Progress signals of one environment (``Runlane.status()``, ``runlane status APP``).

    Each count should fall over time when workers and maintenance are healthy; a process
    that is up but whose counts only grow is not healthy.
    """

    environment: str
    queued_due: int
    running: int
    deferred_past_due: int  # retrying or released runs whose due time passed
    oldest_deferred_due_at: datetime | None
    expired_leases: int  # running attempts whose lease lapsed, not yet finalized
    stuck_cancellations: int  # cancellation_requested runs whose attempt is gone
    tombstones_with_children: int
    tokens_past_timeout: int  # pending wait tokens whose timeout passed, not yet timed out
    resolved_tokens_with_waiting_runs: int  # resolved tokens whose runs are not resumed yet
    maintenance_leases: tuple[MaintenanceLeaseStatus, ...]
    waiting: int = 0  # runs suspended on a token, a run or a sleep
    tombstone_remaining_children: int = 0  # children the pruned parents still wait for
    queues: tuple[QueueStatus, ...] = ()  # every registered queue, and any other with runs
    # unpaused schedules whose awaited slot is long past (database time): maintenance is not
    # firing them (at most 100 ids, the most overdue first)
    late_schedules: tuple[str, ...] = ()
    # runs still waiting on resolved tokens (all of them), and the tokens holding the most (at
    # most 10, most first): a stuck backlog on one token is told from one draining by
    # whether its count falls between looks (seed: alert on terminal tokens whose
    # waiting-run count does not fall)
    runs_waiting_on_resolved_tokens: int = 0
    # of ``running``: runs whose current attempt's handler has not been seen to start (claimed
    # ahead by a worker, or started under a second ago); running - claimed_not_started are
    # executing (RunSnapshot.executing)
    claimed_not_started: int = 0
    resolved_tokens: tuple[ResolvedTokenStatus, ...] = ()
    # the lane's own fields (Lane.status): its outbox, and e.g. the RabbitMQ lane's broker
    lane: LaneStatus = LaneStatus()

    @property
    def outbox_pending(self) -> int | None:
        """Outbox items not yet published (``lane.outbox_pending``; 0 on the polling lane)."""
        return self.lane.outbox_pending

    @property
    def outbox_oldest_age_seconds(self) -> float | None:
        """Age of the oldest pending outbox item (``lane.outbox_oldest_age_seconds``)."""
        return self.lane.outbox_oldest_age_seconds


@attrs.frozen
class QueueInfo:
    """One queue as ``Runlane.list_queues`` reports it: its definition (None where only the
    database knows the queue), its operator state and its runs by status.

    ``counts`` is by status value, so ``counts["running"]`` holds every run in status
    ``running``, claimed ahead or executing. ``running`` and ``claimed`` split the runs
    holding an attempt as ``QueueStatus`` does: ``running`` those whose handler started
    (``RunSnapshot.executing``) plus the ``cancellation_requested`` ones, ``claimed`` those
    a worker holds whose handler has not been seen to start
    (``RunSnapshot.claimed_not_started``); ``running + claimed == counts["running"] +
    counts["cancellation_requested"]``. The CLI's and the console's queue tables show these
    two."""

    name: str
    paused: bool
    paused_reason: str | None
    paused_at: datetime | None
    concurrency_limit: int | None
    rate_limit: RateLimit | None
    key_concurrency_limit: int | None
    counts: dict[str, int]  # runs by status value; statuses without runs are 0
    oldest_queued_age: float | None  # seconds since the oldest due queued run became due
    defined: bool  # False: a queue no code of this runtime defines (known from the database)
    running: int = 0  # handler started, or being cancelled
    claimed: int = 0  # claimed, handler not started (prefetched by a worker)


class WorkerState(enum.StrEnum):
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    LOST = "lost"  # running or stopping, but unseen for three heartbeat intervals


@attrs.frozen
class WorkerInfo:
    """One delivery worker's registration (``Runlane.list_workers``)."""

    worker_id: uuid.UUID
    host: str
    pid: int
    runlane_version: str
    queues: tuple[str, ...]
    concurrency: int
    started_at: datetime
    last_seen_at: datetime
    state: WorkerState
    stopped_at: datetime | None = None


@attrs.frozen
class ScheduleInfo:
    """One schedule's stored definition and state (``Runlane.list_schedules``)."""

    id: str
    cron: str
    timezone: str
    task_id: str | None
    queue: str | None
    paused: bool
    next_fire_at: datetime | None
    last_fired_at: datetime | None
    last_run_id: uuid.UUID | None
    defined: bool = True  # False: stored in the database, not defined by this runtime


@attrs.frozen
class BulkResult:
    """What a bulk action (``retry_runs``, ``cancel_runs``, ``delete_runs``) did:
    ``matched`` runs met the filters, ``changed`` were changed by this call (0 with
    ``dry_run=True``; fewer than matched when others changed or ended meanwhile)."""

    matched: int
    changed: int
    dry_run: bool = False


_T = TypeVar("_T")


@attrs.frozen
class Page(Generic[_T]):
    """One page of a listing, newest first; ``next_cursor`` (opaque) is passed as
    ``cursor=`` for the next, older page, None after the last."""

    items: tuple[_T, ...]
    next_cursor: str | None


@attrs.frozen
class AuditRecord:
    """One operator action, from ``Runlane.list_audit`` (docs/operations.md, Audit trail).

    ``via`` is ``api``, ``cli`` or ``console``; ``actor`` the console's identity (from
    ``authorize``), None from the API and CLI; ``db_role`` the database role that wrote it
    (the database's ``current_user``) and ``os_user`` the operating-system user of the
    process that acted. ``action`` names it (``cancel``, ``retry``, ``reschedule``,
    ``bulk_retry``, ``pause_queue``, ...), ``target`` what it acted on (a run id, a queue, a
    schedule, a bulk action's filters), ``runs`` how many runs it changed (None for a queue
    or schedule), ``changed`` whether it changed anything (a repeat changes nothing), and
    ``details`` what else it said (a bulk action's filters and matches, a new due time)."""

    id: uuid.UUID
    at: datetime
    via: str
    actor: str | None
    db_role: str
    os_user: str | None
    action: str
    target: str | None
    runs: int | None
    changed: bool
    reason: str | None
    details: dict[str, Any]
