"""The plain records of the storage contract (re-exported by :mod:`runlane.storage`)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import attrs

from runlane.errors import RunlaneError
from runlane.flow import Queue
from runlane.models import RunSnapshot, RunStatus, WorkerState


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
    # a search (any of these set): read by ``web_run_search`` within a time budget
    task_prefix: str | None = None
    queue_prefix: str | None = None
    idempotency_key: str | None = None
    payload_contains: Any = None  # a JSON object the payload must contain (jsonb @>)

    @property
    def searching(self) -> bool:
        searched = (self.task_prefix, self.queue_prefix, self.idempotency_key)
        return any(v is not None for v in searched) or self.payload_contains is not None


@attrs.frozen
class RunSearchResult:
    """What ``web_run_search`` found: matching runs newest first (at most the query's
    limit); when its time budget ran out first (``out_of_time``), ``stopped_at`` is the
    ``(created_at, id)`` of the last run it looked at, where a next search continues."""

    runs: list[RunSnapshot]
    stopped_at: tuple[datetime, uuid.UUID] | None
    out_of_time: bool


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
    when given, of ``task_id`` and ``queue`` when given, among ``run_ids`` when given (the
    runs an operator selected); tombstones never."""

    environment: str
    statuses: tuple[RunStatus, ...]
    task_id: str | None = None
    queue: str | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None
    run_ids: tuple[uuid.UUID, ...] | None = None


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
