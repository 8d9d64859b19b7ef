"""The storage contract: everything the engine asks of a database, and nothing more.

Each collaborator of the engine talks to the part it needs (``TriggerStore``,
``ClaimStore``, ``AttemptStore``, ``WaitStore``, ``MaintenanceStore``, ``OperatorStore``);
:class:`Storage`, all of them, is what a lane's ``create_storage`` returns. Methods are
noun-verb over the plain records of ``_records.py``. An attempt's writes are fenced by run
id, attempt number and lease token and return the rows changed: a missing one lost its lease.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

from runlane.models import AuditRecord, RunHistory, RunSnapshot, RunStatus, WaitToken, WorkerInfo
from runlane.stats import StatsBucket
from runlane.storage._audit import AuditEntry, Rescheduled
from runlane.storage._records import (
    BulkBatch,
    BulkFilter,
    ClaimedRun,
    Completion,
    DeliveryState,
    Expiration,
    ExpiredAttempt,
    FailingQueue,
    Failure,
    FailureApplied,
    InsertedRun,
    LeaseRef,
    LimitedClaim,
    MaintenanceFence,
    MaintenanceLeaseRow,
    NewRuns,
    OutboxItem,
    OutboxStatus,
    OutputRefused,
    ProgressWrite,
    PruneResult,
    QueueLimits,
    RetryOutcome,
    RunListQuery,
    RunSearchResult,
    ScheduleDefinition,
    ScheduledRun,
    ScheduleState,
    StepStored,
    StoredSchedule,
    SuspendResult,
    WorkerBeat,
)

__all__ = [
    "AttemptStore",
    "AuditEntry",
    "AuditStore",
    "BulkBatch",
    "BulkFilter",
    "ClaimStore",
    "ClaimedRun",
    "Completion",
    "DeliveryState",
    "Expiration",
    "ExpiredAttempt",
    "FailingQueue",
    "Failure",
    "FailureApplied",
    "InsertedRun",
    "LeaseRef",
    "LimitedClaim",
    "MaintenanceFence",
    "MaintenanceLeaseRow",
    "MaintenanceStore",
    "NewRuns",
    "OperatorStore",
    "OutboxItem",
    "OutboxStatus",
    "OutputRefused",
    "ProgressWrite",
    "PruneResult",
    "QueueLimits",
    "Rescheduled",
    "RetryOutcome",
    "RunListQuery",
    "RunSearchResult",
    "ScheduleDefinition",
    "ScheduleState",
    "ScheduledRun",
    "StepStored",
    "Storage",
    "StorageConnections",
    "StoredSchedule",
    "SuspendResult",
    "TriggerStore",
    "WaitStore",
    "WorkerBeat",
]


class StorageConnections(Protocol):
    """What every collaborator of the engine holds: the connections, and database time."""

    def open(self) -> None:
        """Connect and check connectivity; idempotent. Never inspects or changes the schema."""

    def close(self, timeout: float | None = None) -> None:
        """Release every connection; idempotent. Work still owed (a transport lane's
        pending publishes) gets at most ``timeout`` seconds (None: the storage's bound)."""

    def dedicated(self, name: str, *, durable_commits: bool = True) -> Storage:
        """A view of this storage on a connection of its own, for one thread.
        ``durable_commits=False`` (claims only: a crash merely requeues them) lets a commit
        return before it is durable."""

    def interrupt(self) -> None:
        """Cancel a dedicated view's statement in flight, from another thread; the blocked
        call raises ``StorageUnavailable``. A no-op when idle or not a dedicated view."""

    def database_now(self) -> datetime: ...


class TriggerStore(Protocol):
    """The runtime's producer side and point reads."""

    def run_insert_many(self, runs: NewRuns, *, connection: Any = None) -> list[InsertedRun]:
        """Insert the runs in one round trip, in payload order. A payload whose idempotency
        key matches an existing run of the same task yields that run, ``created=False``.
        With ``connection`` the rows are written in the caller's open transaction."""

    def run_get(self, environment: str, run_id: uuid.UUID) -> RunSnapshot | None: ...

    def run_get_many(
        self, environment: str, run_ids: Sequence[uuid.UUID]
    ) -> dict[uuid.UUID, RunSnapshot]:
        """The runs of ``run_ids`` that exist in the environment, by id, in one query."""


class ClaimStore(Protocol):
    """A lane's acquirer: claims that start attempts under fresh leases."""

    def run_claim(
        self,
        environment: str,
        queues: Sequence[str],
        limit: int,
        lease: timedelta,
        *,
        worker_id: uuid.UUID | None = None,
    ) -> list[ClaimedRun]:
        """Move up to ``limit`` due queued runs to ``running`` under fresh leases, recording
        ``worker_id`` as the worker running their attempts (None: not a delivery worker)."""

    def run_claim_or_next_due(
        self,
        environment: str,
        queues: Sequence[str],
        limit: int,
        lease: timedelta,
        *,
        worker_id: uuid.UUID | None = None,
        due_queues: Sequence[str],
    ) -> tuple[list[ClaimedRun], float | None]:
        """``run_claim``; if none, seconds till ``due_queues``' next run is due (one transaction)"""

    def run_claim_bounded(
        self,
        environment: str,
        queue: str,
        concurrency_limit: int,
        limit: int,
        lease: timedelta,
        *,
        worker_id: uuid.UUID | None = None,
    ) -> list[ClaimedRun]:
        """Claim from a bounded queue: at most ``concurrency_limit`` live leases in the queue
        across every claimer, enforced inside the claim (claimers of the queue serialise)."""

    def run_claim_limited(
        self,
        environment: str,
        queue: str,
        limits: QueueLimits,
        limit: int,
        lease: timedelta,
        *,
        worker_id: uuid.UUID | None = None,
        run_ids: Sequence[uuid.UUID] | None = None,
        visit_limit: int | None = None,
    ) -> LimitedClaim:
        """Claim from a queue with a rate or per-key limit: at most what each limit leaves,
        counted under the queue's claim lock (docs/flow-control.md). ``run_ids``: only those
        runs, when queued and due; ``visit_limit``: the keys one claim may look at."""


class AttemptStore(Protocol):
    """A worker's lifecycle writer and lease tracker: the fenced writes of attempts."""

    def run_complete_many(self, completions: Sequence[Completion]) -> set[uuid.UUID]:
        """Complete the attempts that still hold their lease; returns the run ids applied.
        Raises OutputRefused, writing none, when the database cannot hold their outputs."""

    def run_fail_many(self, failures: Sequence[Failure]) -> list[FailureApplied]:
        """Fail the attempts that still hold their lease: ``retrying`` after ``retry_delay``,
        or ``failed`` when it is None (the caller decides, see
        :func:`runlane.retry.next_retry_delay`); a run whose cancellation was requested
        becomes ``cancelled``. Returns what was applied."""

    def run_release_many(self, environment: str, leases: Sequence[LeaseRef]) -> set[uuid.UUID]:
        """Hand attempts back unconsumed: their runs become claimable again at once (a run
        whose cancellation was requested becomes ``cancelled``)."""

    def run_mark_started(self, leases: Sequence[LeaseRef]) -> int:
        """The attempts' handlers started: their runs show as executing rather than only
        claimed (``RunSnapshot.executing``, ``StatusReport.claimed_not_started``). Fenced;
        returns the runs marked."""

    def run_extend_leases(
        self, leases: Sequence[LeaseRef], lease: timedelta, *, beat: WorkerBeat | None = None
    ) -> dict[LeaseRef, RunStatus]:
        """Push live leases ``lease`` past database now; returns the leases extended with
        their run's status (``cancellation_requested`` tells the holder to stop). An expired
        or lost lease is not extended. ``beat``: the worker's heartbeat, in the same
        statement (with no leases, the heartbeat alone)."""

    def run_progress_many(self, writes: Sequence[ProgressWrite]) -> set[uuid.UUID]:
        """Store each attempt's progress if it still holds its lease; returns the run ids
        written (a missing one lost its lease, and nothing was written to it)."""


class WaitStore(Protocol):
    """A handler's context (and the runtime's tokens): durable steps, waits, sleeps,
    releases."""

    def step_get(self, run_id: uuid.UUID, name: str) -> tuple[bool, Any]:
        """``(found, output)`` of a stored step."""

    def step_store(self, lease: LeaseRef, name: str, output: str) -> StepStored: ...

    def run_suspend(
        self,
        lease: LeaseRef,
        environment: str,
        *,
        token_id: uuid.UUID | None = None,
        run_id: uuid.UUID | None = None,
        wake_at: datetime | None = None,
    ) -> SuspendResult:
        """Suspend the attempt's run on exactly one of a token, a run, or a wake-up time."""

    def run_release(self, lease: LeaseRef, delay: timedelta) -> bool: ...

    def wait_token_create(
        self,
        environment: str,
        token_id: uuid.UUID,
        timeout: timedelta | None,
        idempotency_key: str | None,
    ) -> WaitToken:
        """Create a pending token, or return the one holding ``idempotency_key``."""

    def wait_token_get(self, environment: str, token_id: uuid.UUID) -> WaitToken | None: ...

    def wait_token_complete(self, environment: str, token_id: uuid.UUID, output: str) -> bool:
        """Complete a pending token; False when it was not pending (or does not exist)."""


class MaintenanceStore(Protocol):
    """The maintenance services: the bands' leases and their phases' writes. Every write
    takes the band's fence when run by services: it is checked inside the write's own
    transaction, and a stale one raises StaleLease with nothing written."""

    def maintenance_lease_acquire(
        self, environment: str, band: str, owner: uuid.UUID, lease: timedelta
    ) -> int | None:
        """The new fencing number, or None when another owner's lease is live."""

    def maintenance_lease_refresh(self, fence: MaintenanceFence, lease: timedelta) -> bool: ...

    def maintenance_lease_release(self, fence: MaintenanceFence) -> bool: ...

    def maintenance_missing(self, environment: str) -> bool:
        """True when retries or releases are past due and no maintenance band has a live
        owner (the worker's warning that maintenance is not running)."""

    def run_deliver_due(
        self, environment: str, limit: int, *, fence: MaintenanceFence | None = None
    ) -> int:
        """Make up to ``limit`` due ``retrying``/``released`` runs ``queued``; returns the count."""

    def run_list_expired(self, environment: str, limit: int) -> list[ExpiredAttempt]:
        """Up to ``limit`` attempts whose lease lapsed by database time, oldest first."""

    def run_expire_many(
        self, expirations: Sequence[Expiration], *, fence: MaintenanceFence | None = None
    ) -> list[FailureApplied]:
        """Finalize listed attempts whose run still holds that lease, still lapsed:
        ``retrying`` after the delay, ``failed`` without one, ``cancelled`` when cancellation
        was requested; each attempt is recorded as expired. Returns what was applied."""

    def run_wake_due_queues(self, environment: str, window: timedelta, limit: int) -> list[str]:
        """Announce queues whose delayed runs came due within ``window``; returns them."""

    def run_prune(
        self,
        environment: str,
        retention: dict[RunStatus, timedelta],
        limit: int,
        *,
        fence: MaintenanceFence | None = None,
    ) -> PruneResult: ...

    def run_resume_waiters(
        self,
        environment: str,
        limit: int,
        *,
        token_ids: Sequence[uuid.UUID] | None = None,
        run_ids: Sequence[uuid.UUID] | None = None,
        fence: MaintenanceFence | None = None,
    ) -> int:
        """Queue runs waiting on resolved tokens or ended runs (narrowed to the given ids
        when given); returns how many resumed."""

    def wait_token_time_out_due(
        self, environment: str, limit: int, *, fence: MaintenanceFence | None = None
    ) -> int: ...

    def schedule_state_list(
        self, environment: str, schedule_ids: Sequence[str]
    ) -> list[ScheduleState]: ...

    def schedule_state_reset(
        self,
        environment: str,
        state: ScheduleState,
        *,
        definition: ScheduleDefinition | None = None,
        fence: MaintenanceFence | None = None,
    ) -> None:
        """Store a schedule first seen, or whose cron or timezone changed, awaiting
        ``state.next_slot_at``, with ``definition`` (None keeps the stored one); a row with
        the same cron and timezone is left alone. Never changes ``paused``."""

    def schedule_define(
        self,
        environment: str,
        schedule_id: str,
        definition: ScheduleDefinition,
        *,
        fence: MaintenanceFence | None = None,
    ) -> bytes | None:
        """Store ``definition`` in the schedule's row unless it already holds it; returns
        the digest of the stored definition (as ``schedule_state_list`` reads it), or None
        when there is no such row."""

    def schedule_fire(
        self,
        run: ScheduledRun,
        next_slot_at: datetime,
        expected_slot_at: datetime,
        *,
        fence: MaintenanceFence | None = None,
    ) -> bool:
        """Record the slot and create its run (False when another pass already did, or the
        schedule is paused or no longer awaits ``expected_slot_at``), remember it as the
        schedule's last fire, and advance the schedule's next slot if it still expects
        ``expected_slot_at``."""

    def worker_prune(
        self,
        environment: str,
        retention: timedelta,
        limit: int,
        *,
        fence: MaintenanceFence | None = None,
    ) -> int:
        """Cleanup: delete up to ``limit`` rows of workers stopped or lost, and last seen
        more than ``retention`` ago; returns how many."""

    def stats_fold(
        self,
        environment: str,
        lookback: timedelta,
        max_minutes: int,
        *,
        fence: MaintenanceFence | None = None,
    ) -> int:
        """Fold the rollup's whole minutes closed since the last fold, and the one before
        them (``lookback`` back on the first fold; database time), at most ``max_minutes``,
        from runs and attempts, a second fold of a minute only adding (runs retried or
        deleted since keep their figures); returns the rows written (0: none closed)."""

    def stats_prune(
        self,
        environment: str,
        keep: timedelta,
        limit: int,
        *,
        fence: MaintenanceFence | None = None,
    ) -> int:
        """Retention: delete up to ``limit`` of the rollup's rows older than ``keep``."""


class OperatorStore(Protocol):
    """What operators read and do (the runtime's operator methods, the CLI, the console)."""

    def status_counts(self, environment: str) -> dict[str, Any]:
        """The counts behind ``StatusReport`` (see its fields); ``queues`` holds one mapping
        per queue with runs (name ``queue``, and the counts of ``QueueStatus``)."""

    def maintenance_lease_list(self, environment: str) -> list[MaintenanceLeaseRow]: ...

    def run_list(self, query: RunListQuery) -> list[RunSnapshot]:
        """Up to ``query.limit`` runs newest first, older than ``query.before`` when given."""

    def run_history(self, environment: str, run_id: uuid.UUID) -> RunHistory | None:
        """The run with its finished attempts and stored steps, or None when there is none."""

    def run_retry(self, environment: str, run_id: uuid.UUID) -> RetryOutcome:
        """Queue a ``failed`` or ``cancelled`` run again, due now, with a fresh attempt budget
        (the attempts spent so far count as handed back), and read it as queued before the
        change commits; any other run is left alone."""

    def run_cancel(self, environment: str, run_id: uuid.UUID) -> tuple[RunStatus, RunStatus] | None:
        """``(previous, current)`` status, or None when there is no such run."""

    def run_bulk_count(self, runs: BulkFilter, limit: int) -> int:
        """How many runs meet ``runs`` (at most ``limit``)."""

    def run_bulk_count_within(
        self, runs: BulkFilter, limit: int, seconds: float
    ) -> tuple[int, bool]:
        """``(count, True)`` when counting takes at most ``seconds`` of database time, else
        ``(estimate, False)``: the planner's estimate, read without a scan."""

    def run_bulk_batch(
        self,
        action: str,
        runs: BulkFilter,
        status: RunStatus,
        before: tuple[datetime, uuid.UUID] | None,
        size: int,
    ) -> BulkBatch:
        """One batch of ``action`` (``retry``, ``cancel`` or ``delete``, each as its single-run
        action does it) on up to ``size`` runs of ``runs`` in ``status``, newest first below
        ``before``, in a transaction of its own; runs locked by others are skipped."""

    def worker_list(self, environment: str, *, include_stopped: bool) -> list[WorkerInfo]:
        """The environment's workers, oldest first; one unseen for three heartbeat intervals
        is ``lost``; stopped ones only with ``include_stopped``."""

    def queue_pause(self, environment: str, queue: str, reason: str | None) -> bool:
        """Pause ``queue`` (durably; every claim leaves it out from this commit) with
        ``reason`` replacing an earlier one; True when it was not paused before."""

    def queue_resume(self, environment: str, queue: str) -> bool:
        """Resume ``queue`` and announce it (idle workers claim at once; on a transport lane
        its queued runs get outbox items again); True when it was paused."""

    def queue_known(self, environment: str, queue: str) -> bool:
        """Whether the database knows ``queue``: a queue_states row, or runs of it."""

    def queue_list(self, environment: str) -> list[dict[str, Any]]:
        """One mapping per queue with unfinished runs or a queue_states row, or among the
        queues of the newest finished runs (a bounded read; counts 0), by name: ``queue``, its
        pause (``paused``, ``paused_reason``, ``paused_at``), a count per unfinished status,
        ``claimed`` (running but not seen to start), ``live_leases`` and
        ``oldest_queued_age`` (seconds, database time; None: none due)."""

    def schedule_list(self, environment: str) -> list[StoredSchedule]:
        """Every stored schedule of the environment, by id."""

    def schedule_get(self, environment: str, schedule_id: str) -> StoredSchedule | None:
        """One stored schedule with its ``definition`` (when one is stored)."""

    def schedule_pause(self, environment: str, schedule_id: str) -> bool | None:
        """Pause the schedule: whether it was paused already; None when it is not stored."""

    def schedule_resume(
        self, environment: str, schedule_id: str, cron: str, timezone: str, next_slot_at: datetime
    ) -> bool:
        """Resume a paused schedule whose cron and timezone are still these, awaiting
        ``next_slot_at``; False when it was not paused (or not stored, or redefined)."""

    def schedule_run_now(
        self,
        environment: str,
        schedule_id: str,
        run_id: uuid.UUID,
        idempotency_key: str | None,
        trace_context: str | None,
    ) -> InsertedRun | None:
        """A run made from the schedule's stored definition, due now (or the run holding
        ``idempotency_key``); None when the schedule or its stored definition is missing."""

    def schedule_list_late(self, environment: str, late: timedelta, limit: int) -> list[str]:
        """Ids of unpaused schedules whose awaited slot is more than ``late`` past (database
        time), most overdue first, at most ``limit``."""

    def web_run_extras(
        self, environment: str, run_id: uuid.UUID, children_limit: int
    ) -> dict[str, Any] | None:
        """A run's ``wait_kind``, ``wait_token_id``, ``wait_run_id``, ``trace_context``,
        ``worker_id``, ``pruned_at``, ``remaining_children`` and up to ``children_limit`` of
        its ``children`` newest first (mappings: id, task_id, queue, status, created_at,
        finished_at); None when there is no such run."""

    def web_runs_estimate(self) -> int:
        """The planner's estimate of the rows of runs, all environments (no scan)."""

    def web_run_search(self, query: RunListQuery, seconds: float) -> RunSearchResult:
        """Runs meeting ``query`` (its search fields too: task and queue prefixes, the
        idempotency key, payload containment), newest first below ``query.before``, up to
        ``query.limit``, looking at runs for at most about ``seconds`` of database time."""

    def web_worker_runs(
        self, environment: str, worker_ids: Sequence[str], limit: int
    ) -> dict[str, list[dict[str, Any]]]:
        """The runs each worker holds a lease on now (running or cancellation_requested),
        newest claim first, at most ``limit`` a worker: mappings of id, task_id, queue,
        status, started_at."""

    def stats_read(
        self,
        environment: str,
        *,
        queue: str | None,
        task_id: str | None,
        since: datetime,
        until: datetime,
        bucket: timedelta,
    ) -> list[StatsBucket]:
        """The rollup's minutes in ``[since, until)`` summed per ``bucket`` (aligned on the
        epoch), only the buckets that have rows, oldest first."""


_T = TypeVar("_T")


class AuditStore(Protocol):
    def audit_action(
        self,
        entry: AuditEntry,
        action: Callable[[Storage], _T],
        counted: Callable[[_T], tuple[int | None, bool] | None],
    ) -> _T:
        """``action`` on a view of this storage bound to one transaction, and ``entry``
        (with what ``counted`` says of the result) written in it: both commit or neither.
        The view's operator writes (``run_cancel``, ``run_retry``, ``queue_pause``, one
        ``run_bulk_batch``, ...) are the storage's own."""

    def audit_write(self, entry: AuditEntry, runs: int | None, changed: bool) -> None:
        """A record on its own (a bulk action that matched nothing)."""

    def audit_list(
        self,
        environment: str,
        since: datetime | None,
        before: tuple[datetime, uuid.UUID] | None,
        limit: int,
    ) -> list[AuditRecord]:
        """The environment's actions newest first, at or after ``since``, below ``before``."""

    def audit_prune(
        self,
        environment: str,
        keep_seconds: float,
        limit: int,
        *,
        fence: MaintenanceFence | None = None,
    ) -> int:
        """Retention: delete up to ``limit`` records older than ``keep_seconds`` (database
        time); how many went."""

    def run_reschedule(
        self, environment: str, run_id: uuid.UUID, run_at: datetime | None
    ) -> Rescheduled | None:
        """Move a queued or retrying run's due time to ``run_at`` (None: now, database
        time); None when there is no such run."""

    def run_delete(self, environment: str, run_id: uuid.UUID) -> tuple[RunStatus, bool] | None:
        """Delete a terminal run as ``delete_runs`` does: its status before and whether it
        went (a live run is left alone); None when there is no such run."""


class Storage(
    StorageConnections,
    TriggerStore,
    ClaimStore,
    AttemptStore,
    WaitStore,
    MaintenanceStore,
    OperatorStore,
    AuditStore,
    Protocol,
):
    """What a runtime needs from its database: every collaborator's part (a lane's
    ``create_storage`` returns one). Implementations must be thread-safe."""
