"""The storage contract: everything the engine asks of a database, and nothing more.

The engine never writes SQL. It talks to an object satisfying :class:`Storage`, whose methods
are named noun-verb and take or return the plain records below. Every method that an attempt
uses to write is fenced by run id, attempt number and lease token, and reports which rows it
actually changed; a row missing from the answer lost its lease and nothing was written to it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol

import attrs

from runlane.errors import RunlaneError
from runlane.models import RunHistory, RunSnapshot, RunStatus, WaitToken, WorkerInfo, WorkerState
from runlane.tasks import Queue

__all__ = [
    "BulkBatch",
    "BulkFilter",
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
    "NewRuns",
    "OutboxItem",
    "OutboxStatus",
    "OutputRefused",
    "ProgressWrite",
    "PruneResult",
    "QueueLimits",
    "RetryOutcome",
    "RunListQuery",
    "ScheduleDefinition",
    "ScheduleState",
    "ScheduledRun",
    "StepStored",
    "Storage",
    "StoredSchedule",
    "SuspendResult",
    "WorkerBeat",
]


class OutputRefused(RunlaneError):
    """The database refused the outputs of a completion statement as too large to store
    (JSON text within ``max_output_bytes`` can take several times that as jsonb); nothing
    was written. The message is the database's reason."""


@attrs.frozen
class NewRuns:
    """A batch of runs of one task sharing their options; one row per payload."""

    environment: str
    task_id: str
    queue: str
    ids: Sequence[uuid.UUID]
    payloads: Sequence[str]  # JSON text, already validated
    idempotency_keys: Sequence[str | None]
    priority: int
    max_attempts: int
    delay: timedelta
    run_at: datetime | None
    parent_run_id: uuid.UUID | None = None
    trace_context: str | None = None  # JSON object of W3C trace headers, or None
    # the runs' key under their queue's key_concurrency_limit (docs/flow-control.md)
    concurrency_key: str | None = None


@attrs.frozen
class QueueLimits:
    """What a limited queue's claim counts (``Queue.concurrency_limit``, its rate limit's
    count, window in microseconds and burst, and ``key_concurrency_limit``)."""

    concurrency_limit: int | None = None
    rate_count: int | None = None
    rate_per_us: int | None = None
    rate_burst: int | None = None
    key_limit: int | None = None

    @classmethod
    def of(cls, queue: Queue) -> QueueLimits:
        rate = queue.rate_limit
        return cls(
            concurrency_limit=queue.concurrency_limit,
            rate_count=None if rate is None else rate.count,
            rate_per_us=None if rate is None else rate.per_us,
            rate_burst=None if rate is None else rate.burst,
            key_limit=queue.key_concurrency_limit,
        )


@attrs.frozen
class LimitedClaim:
    """The runs a limited queue's claim started, how long until its rate limit lets the
    next one start (0: not held back by the rate now; None: no rate limit), and whether it
    started nothing only because its walk of a keyed queue stopped at the keys one claim
    may look at (``walked_on``: the next claim goes on from there, and may find due runs)."""

    runs: list[ClaimedRun]
    rate_wait: float | None
    walked_on: bool = False


@attrs.frozen
class InsertedRun:
    """One row of a trigger: the run's id, its queue, and whether this call created it."""

    id: uuid.UUID
    queue: str
    created: bool


@attrs.frozen
class ClaimedRun:
    """A run a claim moved to ``running``, with the lease the attempt must present."""

    id: uuid.UUID
    task_id: str
    queue: str
    attempt: int  # this attempt's number; unique per run, only grows
    attempts_consumed: int  # attempts that count against max_attempts, this one included
    max_attempts: int
    lease_token: uuid.UUID
    payload: Any
    lease_expires_at: datetime
    trace_context: Any = None  # the trigger's W3C trace headers (a dict), if stored
    due_at: datetime | None = None  # when the run became due (database time)
    # the attempt's fence, made once: the worker keys its bookkeeping by it several times
    # for every run
    ref: LeaseRef = attrs.field(init=False, eq=False, repr=False)

    @ref.default
    def _ref(self) -> LeaseRef:
        return LeaseRef(self.id, self.attempt, self.lease_token)


@attrs.frozen(cache_hash=True)
class LeaseRef:
    """The fence an attempt presents: run, attempt number and lease token."""

    run_id: uuid.UUID
    attempt: int
    lease_token: uuid.UUID


@attrs.frozen
class Completion:
    run_id: uuid.UUID
    attempt: int
    lease_token: uuid.UUID
    output: str  # JSON text


@attrs.frozen
class Failure:
    run_id: uuid.UUID
    attempt: int
    lease_token: uuid.UUID
    error: str  # JSON text of a RunError
    retry_delay: timedelta | None  # None: no further attempt


@attrs.frozen
class FailureApplied:
    run_id: uuid.UUID
    status: RunStatus


@attrs.frozen
class MaintenanceFence:
    """The maintenance lease a band's writes present; checked inside each write transaction."""

    environment: str
    band: str
    owner: uuid.UUID
    fencing: int


@attrs.frozen
class MaintenanceLeaseRow:
    band: str
    owner: uuid.UUID
    fencing: int
    expires_at: datetime
    live: bool


@attrs.frozen
class ExpiredAttempt:
    """An attempt whose lease lapsed by database time, as listed for attempt expiry."""

    run_id: uuid.UUID
    task_id: str
    attempt: int
    attempts_consumed: int  # attempts that count against max_attempts, this one included
    max_attempts: int
    lease_token: uuid.UUID
    lease_expires_at: datetime
    cancel_requested: bool  # the run is cancellation_requested: its handler is asked to stop


@attrs.frozen
class Expiration:
    """How attempt expiry finalizes one listed attempt (applied only if the run still holds
    that lease and it is still lapsed)."""

    run_id: uuid.UUID
    attempt: int
    lease_token: uuid.UUID
    error: str  # JSON text of a RunError
    retry_delay: timedelta | None  # None: no further attempt (the run fails)


@attrs.frozen
class ScheduleState:
    """A schedule's row as maintenance reads it: the slot it awaits, whether it is paused, and
    a digest of its stored definition (None where not read)."""

    schedule_id: str
    cron: str
    timezone: str
    next_slot_at: datetime
    paused: bool = False
    definition_digest: bytes | None = None


@attrs.frozen
class ScheduleDefinition:
    """What a schedule's runs are made of, stored with its state so that operators can fire
    it from a database URL alone."""

    task_id: str
    queue: str
    payload: str  # JSON text, validated against the task's schema when it was defined
    priority: int
    max_attempts: int


@attrs.frozen
class StoredSchedule:
    """A stored schedule as operators see it. ``task_id``/``queue`` are None for a row that
    no runtime of schema version 6 has stored a definition in yet; ``definition`` is read
    only by ``schedule_get``."""

    schedule_id: str
    cron: str
    timezone: str
    next_slot_at: datetime
    paused: bool
    task_id: str | None
    queue: str | None
    last_fired_at: datetime | None
    last_run_id: uuid.UUID | None
    definition: ScheduleDefinition | None = None


@attrs.frozen
class ScheduledRun:
    """One schedule slot to fire: the slot row and its run, written together or not at all."""

    environment: str
    schedule_id: str
    slot_at: datetime
    run_id: uuid.UUID
    task_id: str
    queue: str
    priority: int
    payload: str  # JSON text
    max_attempts: int


@attrs.frozen
class StepStored:
    """The answer to a step write: ``fenced`` is False for a stale attempt (nothing written);
    ``output`` is what storage holds now (an earlier writer's output when it won)."""

    fenced: bool
    output: Any


@attrs.frozen
class SuspendResult:
    """``target_open``: the awaited token or run was still unresolved; ``suspended``: the
    run now waits (False with an open target means the attempt lost its lease)."""

    target_open: bool
    suspended: bool


@attrs.frozen
class OutboxItem:
    """An outbox item under a publisher's claim: publish ``run_id`` to ``queue``'s transport
    queue with ``id`` as the message id, then record the result presenting ``claim_token``."""

    id: uuid.UUID
    run_id: uuid.UUID
    environment: str
    queue: str
    claim_token: uuid.UUID


@attrs.frozen
class OutboxStatus:
    """An environment's outbox: items not yet published, and the oldest one's age in
    seconds by database time (None when there is none)."""

    pending: int
    oldest_age_seconds: float | None


@attrs.frozen
class FailingQueue:
    """A queue whose outbox items failed to publish twice or more: the transport could not
    serve it (``Outbox.outbox_failing_queues``)."""

    queue: str
    items: int  # its items that failed twice or more
    failures: int  # the most failures of one of them
    last_error: str | None  # that item's last error
    oldest_age_seconds: float  # of the oldest of them, by database time


@attrs.frozen
class DeliveryState:
    """Why a run named by a delivery was not claimed."""

    status: RunStatus
    queue: str
    due_now: bool
    paused: bool = False  # its queue is paused: the run waits in Postgres until resumed


@attrs.frozen
class RunListQuery:
    """One page of runs newest first (by ``created_at``, then ``id``), optionally narrowed;
    ``before`` is the ``(created_at, id)`` of the previous page's last run."""

    environment: str
    status: RunStatus | None
    task_id: str | None
    queue: str | None
    limit: int
    before: tuple[datetime, uuid.UUID] | None


@attrs.frozen
class RetryOutcome:
    """What ``run_retry`` found: the run's status before (None: no such run), whether it was
    a pruned tombstone, and whether it was queued again; ``run``, when it was, is the run as
    the retry left it (read in the retry's transaction: a worker may claim it the moment it
    commits)."""

    previous: RunStatus | None
    pruned: bool
    retried: bool
    run: RunSnapshot | None = None


@attrs.frozen
class PruneResult:
    deleted: int
    tombstoned: int


@attrs.frozen
class BulkFilter:
    """Which runs a bulk action (retry, cancel, delete by filter) touches: runs of
    ``environment`` in one of ``statuses``, created in ``[created_after, created_before)``
    when given, of ``task_id`` and ``queue`` when given; tombstones never."""

    environment: str
    statuses: tuple[RunStatus, ...]
    task_id: str | None = None
    queue: str | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None


@attrs.frozen
class BulkBatch:
    """One batch of a bulk action: ``visited`` runs locked and acted on (``changed`` of
    them changed), and the ``(created_at, id)`` of the last one, where the next batch of
    the walk starts below (None when the batch was empty)."""

    visited: int
    changed: int
    last: tuple[datetime, uuid.UUID] | None


@attrs.frozen
class WorkerBeat:
    """A delivery worker's registration, sent whole with each heartbeat: the heartbeat
    writes the row if it is missing (a registration that failed at start), so nothing but
    ``state`` and the time it was last seen ever changes. ``heartbeat_seconds`` apart at
    most; unseen for three of them, the worker is shown as lost."""

    worker_id: uuid.UUID
    environment: str
    host: str
    pid: int
    runlane_version: str
    queues: tuple[str, ...]
    concurrency: int
    heartbeat_seconds: float
    state: WorkerState = WorkerState.RUNNING  # running, stopping or stopped


@attrs.frozen
class ProgressWrite:
    """An attempt's last progress (JSON text), written only while it holds its lease."""

    lease: LeaseRef
    progress: str


class Storage(Protocol):
    """What a runtime needs from its database. Implementations must be thread-safe."""

    def open(self) -> None:
        """Connect and check connectivity; idempotent. Never inspects or changes the schema."""

    def close(self, timeout: float | None = None) -> None:
        """Release every connection; idempotent. Work the storage still owes before it
        lets go (a transport lane's pending publishes) gets at most ``timeout`` seconds
        (None: the storage's own bound)."""

    def run_insert_many(self, runs: NewRuns, *, connection: Any = None) -> list[InsertedRun]:
        """Insert the runs in one round trip, in payload order. A payload whose idempotency
        key matches an existing run of the same task yields that run, ``created=False``.
        With ``connection`` the rows are written in the caller's open transaction."""

    def run_get(self, environment: str, run_id: uuid.UUID) -> RunSnapshot | None: ...

    def run_get_many(
        self, environment: str, run_ids: Sequence[uuid.UUID]
    ) -> dict[uuid.UUID, RunSnapshot]:
        """The runs of ``run_ids`` that exist in the environment, by id, in one query."""

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
        """Claim from a queue with a rate limit or a per-key limit (and maybe a concurrency
        limit): at most what each limit leaves, counted inside the claim under the queue's
        claim lock, so every claimer on every path obeys them (docs/flow-control.md). With
        ``run_ids`` (a transport lane's deliveries) only those runs, when queued and due.
        ``visit_limit``: the keys a polling claim of a keyed queue may look at (None: the
        storage's bound on one claim's work)."""

    def run_complete_many(self, completions: Sequence[Completion]) -> set[uuid.UUID]:
        """Complete the attempts that still hold their lease; returns the run ids applied.
        (Storage announces the capacity freed in their queues, and resumes runs waiting on
        them.) Raises OutputRefused, writing none of them, when the database cannot hold
        their outputs (one of them, or all of them in one statement)."""

    def run_fail_many(self, failures: Sequence[Failure]) -> list[FailureApplied]:
        """Fail the attempts that still hold their lease: ``retrying`` after ``retry_delay``,
        or ``failed`` when it is None (the caller decides, see
        :func:`runlane.retry.next_retry_delay`); a run whose cancellation was requested
        becomes ``cancelled``. Returns what was applied."""

    def run_release_many(self, environment: str, leases: Sequence[LeaseRef]) -> set[uuid.UUID]:
        """Hand attempts back unconsumed: their runs become claimable again at once (a run
        whose cancellation was requested becomes ``cancelled``)."""

    def dedicated(self, name: str, *, synchronous_commit: bool = True) -> Storage:
        """A view of this storage on a connection of its own, for one thread. Without
        ``synchronous_commit`` a commit may be lost to a server crash (never to a client
        failure); only claims, which a crash merely returns to the queue, use that."""

    def interrupt(self) -> None:
        """Cancel the statement in flight on a dedicated view's connection, from another
        thread (close at its deadline); the blocked call raises ``StorageUnavailable``. A
        no-op when idle, and on a storage that is not a dedicated view."""

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

    def run_deliver_due(
        self, environment: str, limit: int, *, fence: MaintenanceFence | None = None
    ) -> int:
        """Make up to ``limit`` due ``retrying``/``released`` runs ``queued``; returns the count."""

    # -- maintenance ---------------------------------------------------------------------
    # Every write below takes the band's fence when run by services: it is checked inside the
    # write's own transaction, and a stale one raises StaleLease with nothing written.

    def database_now(self) -> datetime: ...

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

    def maintenance_lease_acquire(
        self, environment: str, band: str, owner: uuid.UUID, lease: timedelta
    ) -> int | None:
        """The new fencing number, or None when another owner's lease is live."""

    def maintenance_lease_refresh(self, fence: MaintenanceFence, lease: timedelta) -> bool: ...

    def maintenance_lease_release(self, fence: MaintenanceFence) -> bool: ...

    def maintenance_lease_list(self, environment: str) -> list[MaintenanceLeaseRow]: ...

    def status_counts(self, environment: str) -> dict[str, Any]:
        """The counts behind ``StatusReport`` (see its fields); ``queues`` holds one mapping
        per queue with runs (name ``queue``, and the counts of ``QueueStatus``)."""

    def maintenance_missing(self, environment: str) -> bool:
        """True when retries or releases are past due and no maintenance band has a live
        owner (the worker's warning that maintenance is not running)."""

    # -- steps, waits, cancellation ------------------------------------------------------

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

    def wait_token_time_out_due(
        self, environment: str, limit: int, *, fence: MaintenanceFence | None = None
    ) -> int: ...

    def run_cancel(self, environment: str, run_id: uuid.UUID) -> tuple[RunStatus, RunStatus] | None:
        """``(previous, current)`` status, or None when there is no such run."""

    # -- inspection and operator actions ---------------------------------------------------

    def run_list(self, query: RunListQuery) -> list[RunSnapshot]:
        """Up to ``query.limit`` runs newest first, older than ``query.before`` when given."""

    def run_history(self, environment: str, run_id: uuid.UUID) -> RunHistory | None:
        """The run with its finished attempts and stored steps, or None when there is none."""

    def run_retry(self, environment: str, run_id: uuid.UUID) -> RetryOutcome:
        """Queue a ``failed`` or ``cancelled`` run again, due now, with a fresh attempt budget
        (the attempts spent so far count as handed back), and read it as queued before the
        change commits; any other run is left alone."""

    # -- bulk actions and progress ---------------------------------------------------------

    def run_bulk_count(self, runs: BulkFilter, limit: int) -> int:
        """How many runs meet ``runs`` (at most ``limit``)."""

    def run_bulk_count_within(
        self, runs: BulkFilter, limit: int, seconds: float
    ) -> tuple[int, bool]:
        """``(count, True)`` as :meth:`run_bulk_count` gives it when the count takes at most
        ``seconds`` of the database's time; else ``(estimate, False)``, the database's
        estimate of how many runs meet ``runs``, read without a scan."""

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

    def run_progress_many(self, writes: Sequence[ProgressWrite]) -> set[uuid.UUID]:
        """Store each attempt's progress if it still holds its lease; returns the run ids
        written (a missing one lost its lease, and nothing was written to it)."""

    # -- delivery workers ----------------------------------------------------------------

    def worker_list(self, environment: str, *, include_stopped: bool) -> list[WorkerInfo]:
        """The environment's registered workers, oldest first; a running or stopping one
        unseen for three heartbeat intervals (database time) is ``lost``. Stopped ones only
        with ``include_stopped``."""

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

    # -- queue operator state ------------------------------------------------------------

    def queue_pause(self, environment: str, queue: str, reason: str | None) -> bool:
        """Pause ``queue`` (durably; every claim leaves it out from this commit) with
        ``reason`` replacing an earlier one; True when it was not paused before."""

    def queue_resume(self, environment: str, queue: str) -> bool:
        """Resume ``queue`` and announce it (idle workers claim at once; on a transport lane
        its queued runs get outbox items again); True when it was paused."""

    def queue_known(self, environment: str, queue: str) -> bool:
        """Whether the database knows ``queue``: a queue_states row, or runs of it."""

    def queue_list(self, environment: str) -> list[dict[str, Any]]:
        """One mapping per queue with unfinished runs or a queue_states row: ``queue``,
        ``paused``, ``paused_reason``, ``paused_at``, the count of each unfinished status by
        its value, ``claimed`` (of the ``running`` runs, those whose current attempt's
        handler has not been seen to start: claimed ahead by a worker, or started under a
        second ago; 0 when absent), ``live_leases`` (running attempts whose lease has not
        lapsed: what ``status()`` reports against a bounded queue's limit), and
        ``oldest_queued_age`` in seconds of database time (None: none due). ``status()`` and
        ``list_queues()`` both read it."""

    # -- schedules: definitions and operator actions ---------------------------------------

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

    def schedule_list(self, environment: str) -> list[StoredSchedule]:
        """Every stored schedule of the environment, by id."""

    def schedule_get(self, environment: str, schedule_id: str) -> StoredSchedule | None:
        """One stored schedule with its ``definition`` (when one is stored)."""

    def schedule_pause(self, environment: str, schedule_id: str) -> bool | None:
        """Pause the schedule (idempotent): whether it was paused already, None when it is
        not stored."""

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

    # -- web console reads (runlane.web) ----------------------------------------------------

    def web_throughput(self, environment: str, cap: int) -> dict[str, Any]:
        """Runs finished per minute over the last hour (database time): ``now_minute``,
        ``minutes`` (a list of (minute, completed, failed, cancelled)) and ``edge``: None, or
        when the hour had more than ``cap`` finishes, the time of the ``cap``-th newest (only
        finishes after it are counted)."""

    def web_run_extras(
        self, environment: str, run_id: uuid.UUID, children_limit: int
    ) -> dict[str, Any] | None:
        """A run's ``wait_kind``, ``wait_token_id``, ``wait_run_id``, ``trace_context``,
        ``worker_id``, ``pruned_at``, ``remaining_children`` and up to ``children_limit`` of
        its ``children`` newest first (mappings: id, task_id, queue, status, created_at,
        finished_at); None when there is no such run."""

    def web_runs_estimate(self) -> int:
        """The planner's estimate of the rows of runs, all environments (no scan)."""
