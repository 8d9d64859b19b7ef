"""The runtime: ``create_runlane`` and the blocking, thread-safe ``Runlane`` facade.

``Runlane`` checks the runtime is open and hands every call to the room that does it:
``_lifetime`` (open, close, what the runtime started), ``_triggering`` (checks and stores
new runs), ``_reads`` (runs, workers, status), the operator's ``_actions`` (cancel, retry,
bulk), ``_queue_admin`` and ``_schedule_admin``, ``_waiting`` (``wait_for_run``, wait
tokens) and ``_services`` (``drain``, workers, maintenance)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, Unpack

from runlane._limits import DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_MAX_PAYLOAD_BYTES
from runlane._operator.bulk import BulkFilters
from runlane._validation import as_payload_list, call_options
from runlane.lanes import Lane
from runlane.maintenance import (
    MaintenanceLimits,
    MaintenanceResult,
    RetentionPolicy,
    ServiceErrorCallback,
    Services,
)
from runlane.models import (
    BulkResult,
    CancelResult,
    DrainResult,
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
from runlane.runtime._actions import RunActions
from runlane.runtime._database_wait import DEFAULT_WAIT_FOR_DATABASE
from runlane.runtime._lifetime import Lifetime
from runlane.runtime._queue_admin import QueueAdmin
from runlane.runtime._reads import Reads
from runlane.runtime._registrations import check_registrations
from runlane.runtime._schedule_admin import ScheduleAdmin
from runlane.runtime._services import ServiceStarts
from runlane.runtime._triggering import Triggering
from runlane.runtime._waiting import Waits
from runlane.schedules import Schedule
from runlane.storage import Storage
from runlane.tasks import Queue, Task
from runlane.worker import Middleware, Worker, check_middleware

__all__ = ["DEFAULT_WAIT_FOR_DATABASE", "Runlane", "create_runlane"]


class Runlane:
    """A runtime: the task catalog, the queues and one lane's storage.

    Every method blocks and is safe to call from any thread. Methods start the runtime on
    first use; ``close()`` closes the workers and services it created, then its connections.
    A closed runtime raises :class:`RunlaneClosed` from every method but ``start()``, which
    opens it again, and ``close()``.
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
        self._life = life = Lifetime(lane, environment, self, self._connected)
        default_queue = next(q.name for q in queues if q.default)
        self._triggering = Triggering(
            environment, self._tasks, self._queues, default_queue, max_payload_bytes, life.opened
        )
        entries = [self._triggering.schedule_entry(s) for s in schedules]
        self._reads = Reads(environment, lane, self._queues, life.opened)
        self._actions = RunActions(environment, life.opened)
        self._queue_admin = QueueAdmin(environment, self._queues, life.opened)
        self._schedule_admin = ScheduleAdmin(environment, entries, life.opened)
        self._waits = Waits(
            environment, max_output_bytes, life.opened, self.get_run, life.end_watcher
        )
        self._services = ServiceStarts(
            environment=environment,
            lane=lane,
            tasks=self._tasks,
            queues=self._queues,
            schedules=entries,
            retention=retention,
            middleware=tuple(middleware),
            max_output_bytes=max_output_bytes,
            trigger=self._triggering.runs,
            life=life,
        )
        life.connect()

    def _connected(self, storage: Storage) -> None:
        self._reads.connect(storage)
        self._services.connect(storage)

    def wrap_attempts(self, middleware: object) -> None:
        """Enter ``middleware`` outermost around the attempts of every worker (and drain)
        made from now on: how an integration (the Flask extension's app context) adds its
        own to those given to ``create_runlane``. For runlane's integrations; an application
        passes ``middleware=`` to ``create_runlane``."""
        (checked,) = check_middleware([middleware])
        self._services.wrap_attempts(checked)

    # -- lifecycle -----------------------------------------------------------------------

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
        """Open connections and check connectivity; idempotent. Never touches the schema.

        On a closed runtime it opens it again (the bounded-pass entry point calls
        ``start()``, ``run_maintenance_once()`` and ``close()`` once per invocation). When
        the database cannot be reached it raises :class:`StorageUnavailable` and the next
        call tries again."""
        self._life.start()

    def close(self, timeout: float | None = None) -> None:
        """Close the workers and services this runtime created (each asked to stop, their
        unfinished runs handed back), then flush and close connections, within ``timeout``
        seconds plus a small constant; idempotent."""
        self._life.close(timeout)

    def __enter__(self) -> Runlane:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def opened_storage(self) -> Storage:
        """This runtime's storage, started as every operator method starts it (a closed
        runtime raises :class:`~runlane.RunlaneClosed`). For runlane's own parts that read
        through the storage (the console); applications use the methods above."""
        return self._life.opened()

    # -- producing -----------------------------------------------------------------------

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

        ``delay`` (a timedelta or seconds) or ``run_at`` set the due time, computed by the
        database. With ``connection`` (a psycopg connection) the run is written in the
        caller's transaction and exists only if it commits. With ``idempotency_key`` a
        second trigger of the same task returns the first run (``created`` is then False).
        Higher ``priority`` is claimed first. ``concurrency_key`` puts the run under its
        queue's ``key_concurrency_limit`` (a queue without one refuses it).
        """
        self._life.check_open()
        options = call_options(
            queue=queue,
            delay=delay,
            run_at=run_at,
            priority=priority,
            max_attempts=max_attempts,
            concurrency_key=concurrency_key,
        )
        keys = None if idempotency_key is None else [idempotency_key]
        (handle,) = self._triggering.runs(task, [payload], keys, options, connection)
        return handle

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
        """Trigger one run per payload in one round trip; handles come back in payload order.

        Every payload is validated before anything is written. ``idempotency_keys``, when
        given, holds one key (or None) per payload; ``concurrency_key`` is every run's.
        """
        self._life.check_open()
        options = call_options(
            queue=queue,
            delay=delay,
            run_at=run_at,
            priority=priority,
            max_attempts=max_attempts,
            concurrency_key=concurrency_key,
        )
        payload_list = as_payload_list(payloads)
        return self._triggering.runs(
            task, payload_list, idempotency_keys, options, connection, batch=True
        )

    # -- reading -------------------------------------------------------------------------

    def get_run(self, run_id: uuid.UUID | str) -> RunSnapshot:
        """The run's current state; raises RunNotFound when this environment has no such run.
        Concurrent calls from several threads are answered by one batched query."""
        self._life.check_open()
        return self._reads.run(run_id)

    def wait_for_run(
        self, run_id: uuid.UUID | str, timeout: timedelta | float | None = None
    ) -> RunSnapshot:
        """Block until the run is terminal and return it; raises TimeoutError after
        ``timeout``. Wakes when the run's end is announced (LISTEN/NOTIFY on the schema's
        ends channel, one listener per runtime while someone waits); looks again every
        second in case an announcement was lost, and polls with a capped backoff (10 ms
        growing to 250 ms) while the listener is not connected or the lane announces
        nothing (``listen=False``)."""
        self._life.check_open()
        return self._waits.for_run(run_id, timeout)

    def cancel(self, run_id: uuid.UUID | str) -> CancelResult:
        """Cancel a run: queued, retrying, released and waiting runs are cancelled at once; a
        running run becomes ``cancellation_requested``, its handler's ``context.cancelled``
        is set (NOTIFY, or its next lease extension), and it ends ``cancelled`` when the
        handler stops (raises, suspends) or its lease lapses; a handler that returns
        normally has completed its run. Cancelling a terminal run changes nothing and says so
        (``changed=False``)."""
        self._life.check_open()
        return self._actions.cancel(run_id)

    # -- inspecting and operating ---------------------------------------------------------

    def list_runs(
        self,
        *,
        status: RunStatus | str | None = None,
        task: Task[Any, Any] | str | None = None,
        queue: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> RunPage:
        """Runs of this environment, newest first (by creation time, then id), ``limit``
        (1 to 1000) at a time; pass ``next_cursor`` as ``cursor`` for the next, older page.

        Served by an index whatever the filters: a page walks the runs newest first (in one
        ``status`` when given) from the cursor on, so its cost does not grow with the table
        or with how deep the page is. ``task`` (a task or its id) and ``queue`` filter the
        runs that walk meets: a page of a task that is rare among recent runs reads the
        runs in between. Runs triggered while paging appear on no later page (they are
        newer than the cursor)."""
        self._life.check_open()
        return self._reads.runs(status, task, queue, limit, cursor)

    def get_run_history(self, run_id: uuid.UUID | str) -> RunHistory:
        """The run with its finished attempts (number, outcome, error, start and end) in
        order and its stored steps, read in one snapshot; raises RunNotFound."""
        self._life.check_open()
        return self._reads.history(run_id)

    def retry_run(self, run_id: uuid.UUID | str) -> RunSnapshot:
        """Queue a ``failed`` or ``cancelled`` run again, due now, with a fresh attempt
        budget (``max_attempts`` more attempts); its attempt numbers keep growing, its
        attempts history and stored steps are kept, its error and output are cleared. Any
        other status raises RunStateConflict saying what to do instead; an unknown run
        raises RunNotFound. Returns the run as queued."""
        self._life.check_open()
        return self._actions.retry(run_id)

    # -- bulk actions --------------------------------------------------------------------

    def retry_runs(self, **filters: Unpack[BulkFilters]) -> BulkResult:
        """``retry_run`` for every failed or cancelled run the filters match (``status``:
        failed and/or cancelled; ``task``, ``queue``; created in ``[created_after,
        created_before)``, timezone-aware; at most ``limit`` runs). Refused without a filter
        unless ``all=True``. Works in batches of 500 runs, each its own short transaction
        that skips runs locked by others, so claims never wait long behind it; safe to
        re-run, and an interruption (``on_batch`` raising KeyboardInterrupt, a killed
        process) leaves every finished batch done and the rest untouched.
        ``on_batch(done, matched)`` is called after each batch; ``dry_run=True`` only
        counts. Returns ``BulkResult(matched, changed)``."""
        self._life.check_open()
        return self._actions.bulk("retry", filters)

    def cancel_runs(self, **filters: Unpack[BulkFilters]) -> BulkResult:
        """``cancel`` for every queued, retrying, released, waiting or running run the
        filters match (running ones become ``cancellation_requested`` and end cancelled
        when their handlers stop); filters, batches and ``on_batch`` as ``retry_runs``."""
        self._life.check_open()
        return self._actions.bulk("cancel", filters)

    def delete_runs(self, **filters: Unpack[BulkFilters]) -> BulkResult:
        """Delete the terminal runs (completed, failed, cancelled) the filters match, with
        their attempts and steps, as cleanup does: a run that still has children becomes a
        tombstone counting them (cleanup deletes it once they are gone). A non-terminal
        ``status`` raises ConfigurationError, nothing deleted. Filters, batches and
        ``on_batch`` as ``retry_runs``."""
        self._life.check_open()
        return self._actions.bulk("delete", filters)

    # -- queues --------------------------------------------------------------------------

    def pause_queue(self, name: str, *, reason: str | None = None) -> bool:
        """Pause queue ``name`` in this environment: its runs are no longer claimed by any
        worker, ``drain()`` or RabbitMQ consumer on any host, from the moment the pause
        commits (the claim statements read it) until ``resume_queue``. Triggers into it
        still succeed (the runs wait, queued); attempts already running finish. Durable
        (stored in Postgres) and idempotent; ``reason`` (at most 500 characters) is shown by
        ``list_queues`` and replaces an earlier one. The queue must be defined by this
        runtime or known to the database (runs or an earlier pause), else
        ConfigurationError. Returns True when the queue was not paused before."""
        self._life.check_open()
        return self._queue_admin.pause(name, reason)

    def resume_queue(self, name: str) -> bool:
        """Resume a paused queue: idle workers serving it are woken at once (NOTIFY; their
        poll is the fallback), and on a transport lane its queued runs are published again.
        Idempotent (resuming a running queue changes nothing, and re-publishes what a resume
        interrupted part way left unpublished). Unknown queues as for ``pause_queue``.
        Returns True when the queue was paused."""
        self._life.check_open()
        return self._queue_admin.resume(name)

    def list_queues(self) -> list[QueueInfo]:
        """Every queue this runtime defines and every queue the database knows in this
        environment (unfinished runs, or a pause row; ``defined=False``), by name: paused
        state, limits, unfinished runs by status and the age of the oldest due queued run
        (database time). Index-served: terminal runs are not counted."""
        self._life.check_open()
        return self._queue_admin.infos()

    # -- workers -------------------------------------------------------------------------

    def list_workers(self, *, include_stopped: bool = False) -> list[WorkerInfo]:
        """The delivery workers of this environment, on every host and lane, oldest first:
        id, host, pid, runlane version, queues, concurrency, start, last heartbeat and
        state. A running or stopping worker unseen for three heartbeat intervals (database
        time: it crashed, froze, or lost the database) is ``lost``; stopped workers only with
        ``include_stopped``. Cleanup removes stopped and lost rows after
        ``RetentionPolicy.workers``."""
        self._life.check_open()
        return self._reads.workers(include_stopped)

    # -- schedules -----------------------------------------------------------------------

    def list_schedules(self) -> list[ScheduleInfo]:
        """Every schedule stored in this environment and every one this runtime defines, by
        id, with its task, queue, ``paused``, and the slot of its last run
        (``last_fired_at``, in the schedule's time zone) and that run's id.

        ``next_fire_at`` is the slot the schedule awaits (computed with its cron expression
        in its time zone, and shown in that zone): a time in the past means maintenance has
        not fired it yet (see ``status().late_schedules``). It is None while the schedule is
        paused: a paused schedule fires nothing, and resuming it awaits the first slot after
        the resume. Schedules this runtime defines that no maintenance pass has stored yet
        are listed with the slot their first pass will await. ``defined`` is False for a
        schedule only the database knows (defined by another application, or removed from
        the code). Works on a runtime built with no tasks."""
        self._life.check_open()
        return self._schedule_admin.infos()

    def pause_schedule(self, id: str) -> bool:
        """Pause schedule ``id`` in this environment: from the moment the pause commits no
        maintenance replica fires it (a slot being fired at that moment finishes first), until
        ``resume_schedule``. Durable (stored in Postgres) and idempotent; a run it already
        created is not touched. Returns True when it was not paused before. An id no
        schedule has (stored, or defined by this runtime) raises ConfigurationError; list
        them with ``runlane schedules list``."""
        self._life.check_open()
        return self._schedule_admin.pause(id)

    def resume_schedule(self, id: str) -> bool:
        """Resume a paused schedule: it awaits the first slot after the database's time of
        the resume; the slots it missed while paused are not caught up (whatever its
        ``catch_up``). Idempotent (resuming a schedule that is not paused changes nothing).
        Returns True when it was paused. Unknown ids as for ``pause_schedule``."""
        self._life.check_open()
        return self._schedule_admin.resume(id)

    def trigger_schedule_now(self, id: str, *, idempotency_key: str | None = None) -> RunHandle:
        """Create one run of schedule ``id`` now, as one of its slots would: its task, queue,
        payload, priority and attempt budget. The schedule's slots, last fire and pause are
        not touched (a paused schedule can be run this way).

        The run is made from this runtime's definition when it defines the schedule, else
        from the one stored with the schedule's state (so a runtime built from a database
        URL alone, with no tasks, can run it); a stored payload is not validated again: it
        was validated against the task's schema by the application that stored it. Each
        call creates a new run ("run now"); with ``idempotency_key`` a repeated call returns
        the run the first one created (``created`` is then False), for safe retries of the
        request. Unknown ids as for ``pause_schedule``."""
        self._life.check_open()
        return self._schedule_admin.run_now(id, idempotency_key)

    # -- wait tokens ---------------------------------------------------------------------

    def create_wait_token(
        self,
        *,
        timeout: timedelta | float | None = None,
        idempotency_key: str | None = None,
    ) -> WaitToken:
        """A pending token that a handler can wait on (``context.wait_for_token``); it times
        out after ``timeout`` (database time) unless completed first. With an
        ``idempotency_key``, a second call returns the first token."""
        self._life.check_open()
        return self._waits.create_token(timeout, idempotency_key)

    def get_wait_token(self, token_id: uuid.UUID | str) -> WaitToken:
        self._life.check_open()
        return self._waits.get_token(token_id)

    def complete_wait_token(self, token_id: uuid.UUID | str, output: Any = None) -> WaitToken:
        """Complete a pending token with ``output`` and return its state. Completing a token
        that is already completed or timed out changes nothing and returns its state.

        The completion commits first; then one small pass resumes the runs waiting on the
        token. If that pass fails the completion still stands and maintenance resumes them.
        """
        self._life.check_open()
        return self._waits.complete_token(token_id, output)

    # -- executing -----------------------------------------------------------------------

    def drain(
        self,
        *,
        max_runs: int | None = None,
        queues: Sequence[str] | None = None,
        stop: threading.Event | None = None,
        on_progress: Callable[[DrainResult], None] | None = None,
    ) -> DrainResult:
        """Execute currently due runs in the calling thread, one at a time.

        Returns when no run is due, ``max_runs`` handlers have run, or ``stop`` is set. Runs
        due later (delayed, retrying, released) do not keep it open. It runs attempts
        through the worker's path: bounded queues are honoured, results are recorded by the
        lifecycle writer and flushed before it returns, leases are kept and timeouts
        enforced. A claimed run whose task this runtime does not register is failed with
        TaskNotFound and not counted. Transport lanes cannot drain (ConfigurationError).
        The result counts attempts that completed, failed for good and were retried;
        ``on_progress(result_so_far)`` is called after each attempt.
        """
        self._life.check_open()
        return self._services.drain(max_runs, queues, stop, on_progress)

    def create_delivery_worker(
        self,
        *,
        concurrency: int,
        queues: Sequence[str | Queue] | None = None,
        claim_batch: int | None = None,
        wait_for_database: float | None = DEFAULT_WAIT_FOR_DATABASE,
    ) -> Worker:
        """Start a worker executing runs of ``queues`` (default: every registered queue) in
        ``concurrency`` threads. Close it with ``close()`` or use it as a context manager;
        ``wait_until_closed()`` observes it.

        ``claim_batch`` (default twelve times ``concurrency``, at most 500) caps one claim.
        While a backlog lasts and handlers are short (under 20 ms on average), the worker
        keeps runs claimed ahead of free slots, claiming the next batch once fewer than
        ``claim_batch - concurrency`` wait (at most about two batches, under half a second
        of work), so slots do not wait on claims; their leases are kept alive, a run that
        waited a second for a slot is handed back, and bounded queues never claim ahead.

        ``wait_for_database`` (seconds, default 120; None: no limit; 0: fail at once): how
        long the start waits for a database that is restarting, starting up, refusing
        connections or out of connection slots, logging a line per retry; what no wait fixes
        (a host that does not resolve, a refused password, a missing database or schema)
        raises at once. ``close()`` from another thread ends the wait."""
        self._life.check_open()
        return self._services.delivery_worker(concurrency, queues, claim_batch, wait_for_database)

    # -- maintenance ---------------------------------------------------------------------

    def run_maintenance_once(self, limits: MaintenanceLimits | None = None) -> MaintenanceResult:
        """One bounded maintenance pass for this environment, every phase of
        ``MaintenancePhase`` in order; the first failure propagates."""
        self._life.check_open()
        return self._services.maintenance_once(limits)

    def start_services(
        self,
        *,
        on_service_error: ServiceErrorCallback | None = None,
        limits: MaintenanceLimits | None = None,
        lease_duration: timedelta = timedelta(seconds=30),
        wait_for_database: float | None = DEFAULT_WAIT_FOR_DATABASE,
    ) -> Services:
        """Run maintenance as supervised loops in background threads, one per band; each band
        is owned by one replica at a time through a durable lease. ``on_service_error(error,
        info)`` receives every failed pass (``info.phase``); without it failures are logged.
        ``wait_for_database``: as ``create_delivery_worker``'s."""
        self._life.check_open()
        return self._services.services(on_service_error, limits, lease_duration, wait_for_database)

    def status(self) -> StatusReport:
        """The progress signals an operator should alert on (see StatusReport)."""
        self._life.check_open()
        return self._reads.status()


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
    """Build a runtime. Nothing connects until ``start()`` or the first call that needs it.

    When no queue is marked ``default=True``, a queue named ``"default"`` is added and used
    for tasks that name no queue.

    ``max_payload_bytes`` and ``max_output_bytes`` (default 1 MiB each, at most 64 MiB) cap
    the size of a payload, and of an output (a handler's return value, a step's output, a
    wait token's output), measured on its JSON text in UTF-8. An oversized payload raises
    PayloadValidationError and writes nothing; see docs/bad-input.md for the rest.

    ``middleware`` is a list of callables ``(context) -> ContextManager``, each entered
    around every attempt in the handler's thread (first listed outermost): a Flask app
    context, a database session, an error-reporting scope. An exception one raises fails the
    attempt as the handler's would. One that cannot be such a callable (not callable, not
    taking one argument, a generator function without ``@contextmanager``, annotated to
    return something else) is refused here with a ConfigurationError.
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
