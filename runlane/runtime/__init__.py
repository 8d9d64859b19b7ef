"""The runtime: ``create_runlane`` and the ``Runlane`` facade, which checks the runtime is
open and hands each call to its room (``_rooms.py`` wires them)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, Unpack

from runlane._limits import DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_MAX_PAYLOAD_BYTES
from runlane._operator.bulk import BulkFilters
from runlane._operator.runs import RunSearch
from runlane._validation import TriggerOptions, as_payload_list
from runlane.lanes import Lane
from runlane.maintenance import (
    MaintenanceLimits,
    MaintenanceResult,
    RetentionPolicy,
    ServiceErrorCallback,
    Services,
)
from runlane.models import (
    AuditRecord,
    BulkResult,
    CancelResult,
    DrainResult,
    Page,
    QueueInfo,
    RunHandle,
    RunHistory,
    RunPage,
    RunSnapshot,
    RunStatus,
    ScheduleInfo,
    StatusReport,
    WaitToken,
    WorkerInfo,
)
from runlane.runtime._audit import acting_as
from runlane.runtime._database_wait import DEFAULT_WAIT_FOR_DATABASE
from runlane.runtime._registrations import check_registrations
from runlane.runtime._rooms import Rooms, wire_rooms
from runlane.runtime._stats import StatsOptions
from runlane.schedules import Schedule
from runlane.stats import Stats
from runlane.storage import Storage
from runlane.tasks import Queue, Task
from runlane.worker import Middleware, Worker, check_middleware

__all__ = ["DEFAULT_WAIT_FOR_DATABASE", "Runlane", "acting_as", "create_runlane"]


class Runlane:
    """A runtime: the task catalog, the queues and one lane's storage.

    Every method blocks, is thread-safe and starts the runtime on first use. A closed runtime
    raises :class:`RunlaneClosed` from every method but ``start()`` (which opens it again)
    and ``close()``. Details per method: docs/reference/runlane.md.
    """

    def __init__(
        self,
        *,
        lane: Lane,
        queues: Sequence[Queue],
        tasks: Sequence[Task[Any, Any]],
        schedules: Sequence[Schedule],
        retention: RetentionPolicy,
        environment: str,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        middleware: Sequence[Middleware] = (),
    ) -> None:
        self.environment = environment
        self.max_payload_bytes = max_payload_bytes
        self.max_output_bytes = max_output_bytes
        self._lane = lane
        self._queues = {q.name: q for q in queues}
        self._tasks = {t.id: t for t in tasks}
        self._rooms = rooms = wire_rooms(
            self,
            self.get_run,
            lane=lane,
            queues=self._queues,
            tasks=self._tasks,
            schedules=schedules,
            retention=retention,
            environment=environment,
            limits=(max_payload_bytes, max_output_bytes),
            middleware=middleware,
        )
        self._life, self._triggering = rooms.life, rooms.triggering

    def _open(self) -> Rooms:
        """The rooms, once the runtime is checked to be open: every method's first step."""
        self._life.check_open()
        return self._rooms

    def wrap_attempts(self, middleware: object) -> None:
        """Enter ``middleware`` outermost around later workers' attempts (for integrations)."""
        self._rooms.services.wrap_attempts(*check_middleware([middleware]))

    @property
    def lane(self) -> Lane:
        return self._lane

    @property
    def queues(self) -> dict[str, Queue]:
        return dict(self._queues)

    @property
    def tasks(self) -> dict[str, Task[Any, Any]]:
        return dict(self._tasks)

    def start(self) -> None:
        """Open connections and check connectivity; idempotent; reopens a closed runtime."""
        self._life.start()

    def close(self, timeout: float | None = None) -> None:
        """Close what this runtime started, then its connections, within ``timeout``; idempotent."""
        self._life.close(timeout)

    def __enter__(self) -> Runlane:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def opened_storage(self) -> Storage:
        """This runtime's storage, started; for runlane's own readers such as the console."""
        return self._life.opened()

    def trigger(
        self,
        task: Task[Any, Any] | str,
        payload: Any,
        *,
        queue: str | None = None,
        delay: timedelta | float | None = None,
        run_at: datetime | None = None,
        idempotency_key: str | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        connection: Any = None,
        concurrency_key: str | None = None,
    ) -> RunHandle:
        """Validate ``payload`` and store a new run; nothing is written if validation fails.

        ``delay``/``run_at`` set the due time (database time); ``connection`` writes the run
        in the caller's psycopg transaction; a repeated ``idempotency_key`` returns the first
        run (``created=False``); higher ``priority`` is claimed first; ``concurrency_key``
        needs the queue's ``key_concurrency_limit``.
        """
        self._life.check_open()
        options = TriggerOptions.of(queue, delay, run_at, priority, max_attempts, concurrency_key)
        return self._triggering.one(task, payload, idempotency_key, options, connection)

    def trigger_many(
        self,
        task: Task[Any, Any] | str,
        payloads: Iterable[Any],
        *,
        queue: str | None = None,
        delay: timedelta | float | None = None,
        run_at: datetime | None = None,
        idempotency_keys: Sequence[str | None] | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        connection: Any = None,
        concurrency_key: str | None = None,
    ) -> list[RunHandle]:
        """Trigger one run per payload in one round trip, all validated first; handles in order."""
        self._life.check_open()
        options = TriggerOptions.of(queue, delay, run_at, priority, max_attempts, concurrency_key)
        batch = as_payload_list(payloads)
        return self._triggering.runs(task, batch, idempotency_keys, options, connection, batch=True)

    def get_run(self, run_id: uuid.UUID | str) -> RunSnapshot:
        """The run's current state; raises RunNotFound. Concurrent calls share one query."""
        return self._open().reads.run(run_id)

    def wait_for_run(
        self, run_id: uuid.UUID | str, timeout: timedelta | float | None = None
    ) -> RunSnapshot:
        """Block until the run is terminal and return it; TimeoutError after ``timeout``."""
        return self._open().waits.for_run(run_id, timeout)

    def cancel(self, run_id: uuid.UUID | str, *, reason: str | None = None) -> CancelResult:
        """Cancel a run (a running one once its handler stops); a terminal one is left as is."""
        return self._open().actions.cancel(run_id, reason)

    def list_runs(
        self,
        *,
        status: RunStatus | str | None = None,
        task: Task[Any, Any] | str | None = None,
        queue: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
        **search: Unpack[RunSearch],
    ) -> RunPage:
        """Runs newest first, ``limit`` at a time; ``next_cursor`` pages on. Search keywords
        (:class:`RunSearch`) look within ``search_seconds`` and report ``searched_to``."""
        return self._open().reads.runs(status, task, queue, limit, cursor, search=search)

    def get_run_history(self, run_id: uuid.UUID | str) -> RunHistory:
        """The run, its finished attempts and stored steps in one snapshot; or RunNotFound."""
        return self._open().reads.history(run_id)

    def retry_run(self, run_id: uuid.UUID | str, *, reason: str | None = None) -> RunSnapshot:
        """Queue a failed or cancelled run again with a fresh attempt budget, history kept."""
        return self._open().actions.retry(run_id, reason)

    def reschedule_run(
        self, run_id: uuid.UUID | str, *, run_at: datetime | None, reason: str | None = None
    ) -> RunSnapshot:
        """Move a queued or retrying run's due time to ``run_at`` (None: now); audited."""
        return self._open().audit.reschedule(run_id, run_at, reason)

    def delete_run(self, run_id: uuid.UUID | str, *, reason: str | None = None) -> bool:
        """Delete one terminal run as ``delete_runs`` does; a live one raises RunStateConflict."""
        return self._open().actions.delete(run_id, reason)

    def list_audit(
        self, *, since: datetime | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page[AuditRecord]:
        """The operator actions of this environment, newest first: who, when, what and why."""
        return self._open().audit.list(since, limit, cursor)

    def retry_runs(self, **filters: Unpack[BulkFilters]) -> BulkResult:
        """``retry_run`` for every failed or cancelled run the filters match (``status``,
        ``task``, ``queue``, ``created_after``, ``created_before``, ``limit``; ``all=True``
        without a filter). Works in resumable batches of 500, each its own transaction;
        ``on_batch(done, matched)`` after each, ``dry_run=True`` only counts."""
        return self._open().actions.bulk("retry", filters)

    def cancel_runs(self, **filters: Unpack[BulkFilters]) -> BulkResult:
        """``cancel`` for every live run the filters match, in batches as ``retry_runs``."""
        return self._open().actions.bulk("cancel", filters)

    def delete_runs(self, **filters: Unpack[BulkFilters]) -> BulkResult:
        """Delete the terminal runs the filters match (parents with children stay as tombstones)."""
        return self._open().actions.bulk("delete", filters)

    def pause_queue(self, name: str, *, reason: str | None = None) -> bool:
        """Stop every claim of queue ``name`` in this environment, durably, until
        ``resume_queue``; triggers still succeed. Returns True when it was not paused."""
        return self._open().queue_admin.pause(name, reason)

    def resume_queue(self, name: str, *, reason: str | None = None) -> bool:
        """Resume a paused queue and wake its idle workers; True when it was paused."""
        return self._open().queue_admin.resume(name, reason)

    def list_queues(self) -> list[QueueInfo]:
        """Every queue defined here or known to the database: pause, limits, counts, oldest age."""
        return self._open().queue_admin.infos()

    def list_workers(self, *, include_stopped: bool = False) -> list[WorkerInfo]:
        """The delivery workers of this environment, oldest first; a worker unseen for
        three heartbeat intervals is ``lost``; stopped ones only with ``include_stopped``."""
        return self._open().reads.workers(include_stopped)

    def list_schedules(self) -> list[ScheduleInfo]:
        """Every schedule stored or defined here: pause, last fire, ``next_fire_at``."""
        return self._open().schedule_admin.infos()

    def pause_schedule(self, id: str, *, reason: str | None = None) -> bool:
        """Stop schedule ``id`` firing, durably, until resumed; True when it was not paused."""
        return self._open().schedule_admin.pause(id, reason)

    def resume_schedule(self, id: str, *, reason: str | None = None) -> bool:
        """Resume a paused schedule from its next slot (missed ones are skipped); True if paused."""
        return self._open().schedule_admin.resume(id, reason)

    def trigger_schedule_now(
        self, id: str, *, idempotency_key: str | None = None, reason: str | None = None
    ) -> RunHandle:
        """Create one run of schedule ``id`` now, as its slot would; its state is untouched."""
        return self._open().schedule_admin.run_now(id, idempotency_key, reason)

    def create_wait_token(
        self,
        *,
        timeout: timedelta | float | None = None,
        idempotency_key: str | None = None,
    ) -> WaitToken:
        """A pending token a handler can wait on, timing out after ``timeout`` (database time)."""
        return self._open().waits.create_token(timeout, idempotency_key)

    def get_wait_token(self, token_id: uuid.UUID | str) -> WaitToken:
        """The token's current state."""
        return self._open().waits.get_token(token_id)

    def complete_wait_token(self, token_id: uuid.UUID | str, output: Any = None) -> WaitToken:
        """Complete a pending token with ``output``, resume its waiters, return its state."""
        return self._open().waits.complete_token(token_id, output)

    def drain(
        self,
        *,
        max_runs: int | None = None,
        queues: Sequence[str] | None = None,
        stop: threading.Event | None = None,
        on_progress: Callable[[DrainResult], None] | None = None,
    ) -> DrainResult:
        """Execute currently due runs in the calling thread until none is due,
        ``max_runs`` ran, or ``stop`` is set; ``on_progress`` is called after each attempt.
        Polling lanes only."""
        return self._open().services.drain(max_runs, queues, stop, on_progress)

    def create_delivery_worker(
        self,
        *,
        concurrency: int,
        queues: Sequence[str | Queue] | None = None,
        claim_batch: int | None = None,
        wait_for_database: float | None = DEFAULT_WAIT_FOR_DATABASE,
    ) -> Worker:
        """Start a worker running ``queues`` (default: all) in ``concurrency`` threads;
        ``claim_batch`` caps one claim, ``wait_for_database`` is how long its start waits
        for the database (seconds; None: no limit)."""
        return self._open().services.delivery_worker(
            concurrency, queues, claim_batch, wait_for_database
        )

    def run_maintenance_once(self, limits: MaintenanceLimits | None = None) -> MaintenanceResult:
        """One bounded maintenance pass, every phase in order; the first failure propagates."""
        return self._open().services.maintenance_once(limits)

    def start_services(
        self,
        *,
        on_service_error: ServiceErrorCallback | None = None,
        limits: MaintenanceLimits | None = None,
        lease_duration: timedelta = timedelta(seconds=30),
        wait_for_database: float | None = DEFAULT_WAIT_FOR_DATABASE,
    ) -> Services:
        """Run maintenance as supervised background loops, one per band, each band owned by
        one replica through a lease."""
        return self._open().services.services(
            on_service_error, limits, lease_duration, wait_for_database
        )

    def status(self) -> StatusReport:
        """The progress signals an operator should alert on (see StatusReport)."""
        return self._open().reads.status()

    def stats(self, **options: Unpack[StatsOptions]) -> Stats:
        """The per-minute rollup in buckets: ``queue``, ``task``, ``since`` (default an hour
        before ``until``), ``until`` (default now), ``bucket`` (docs/observability.md)."""
        return self._open().stats.read(options)


def create_runlane(
    *,
    lane: Lane,
    queues: Sequence[Queue] = (),
    tasks: Sequence[Task[Any, Any]] = (),
    schedules: Sequence[Schedule] = (),
    retention: RetentionPolicy | None = None,
    environment: str = "default",
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    middleware: Sequence[Middleware] = (),
) -> Runlane:
    """Build a runtime; nothing connects until it is first used.

    Without a ``default=True`` queue a queue named ``"default"`` is added. The byte limits
    (1 MiB each by default) cap a payload's and an output's JSON text; ``middleware`` holds
    callables ``(context) -> ContextManager`` entered around every attempt, first outermost.
    """
    queue_list, checked_middleware = check_registrations(
        lane=lane,
        queues=queues,
        tasks=tasks,
        schedules=schedules,
        retention=retention,
        environment=environment,
        limits=(max_payload_bytes, max_output_bytes),
        middleware=middleware,
    )
    return Runlane(
        lane=lane,
        queues=queue_list,
        tasks=list(tasks),
        schedules=list(schedules),
        retention=retention or RetentionPolicy(),
        environment=environment,
        max_payload_bytes=max_payload_bytes,
        max_output_bytes=max_output_bytes,
        middleware=checked_middleware,
    )
