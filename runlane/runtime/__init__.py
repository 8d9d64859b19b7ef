"""The runtime: ``create_runlane`` and the blocking, thread-safe ``Runlane`` facade."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, Unpack

import attrs

from runlane import _telemetry
from runlane._attempt import Middleware, check_middleware
from runlane._codec import OutputNotSerializable, encode_output, encode_payload
from runlane._ids import new_run_id, new_run_ids
from runlane._limits import (
    DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_CLAIM_BATCH,
    MAX_LEASE,
    MIN_LEASE,
    check_limit,
    check_name,
)
from runlane._operator import workers as _workers
from runlane._operator.bulk import BulkFilters, bulk_action, bulk_filter
from runlane._operator.runs import list_query, retry_conflict, run_page
from runlane._validation import (
    DEFAULT_OPTIONS,
    TriggerOptions,
    as_duration,
    as_int32,
    as_payload_list,
    as_run_at,
    call_options,
    check_idempotency_key,
    run_key,
    token_key,
    with_default_queue,
)
from runlane.errors import (
    ConfigurationError,
    PayloadValidationError,
    RunlaneClosed,
    RunNotFound,
    TaskNotFound,
    WaitTokenNotFound,
    WorkerFailed,
)
from runlane.flow import check_run_key
from runlane.lanes import Lane, RunEndWatcher
from runlane.maintenance._pass import MaintenanceScope, ScheduleEntry, run_maintenance_pass
from runlane.maintenance._services import ServiceErrorCallback, Services
from runlane.maintenance._types import MaintenanceLimits, MaintenanceResult, RetentionPolicy
from runlane.models import (
    BulkResult,
    CancelResult,
    DrainResult,
    MaintenanceLeaseStatus,
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
from runlane.runtime import _queue_admin, _schedule_admin
from runlane.runtime._backend import Backend
from runlane.runtime._database_wait import DEFAULT_WAIT_FOR_DATABASE, DatabaseWait
from runlane.runtime._reads import PointReads
from runlane.schedules import Schedule
from runlane.storage import NewRuns, Storage
from runlane.tasks import Queue, Task
from runlane.toolkit import Closing, as_int, as_timedelta, as_wait_timeout, shown
from runlane.worker import Worker
from runlane.worker._worker import WorkerOptions, check_worker_arguments

__all__ = ["Runlane", "create_runlane"]

log = logging.getLogger("runlane")

_EAGER_RESUME_LIMIT = 100
# wait_for_run: while run ends are announced, how often it still looks (a lost announcement)
_ENDS_FALLBACK_POLL_SECONDS = 1.0
_end_watchers = iter(range(1, 1 << 62))
# a worker whose threads could not all start: what its started slots get to stop
_START_FAILED_CLOSE_SECONDS = 10.0


@attrs.frozen
class _Plan:
    """A trigger's options checked for one task (Runlane._plan)."""

    task: Task[Any, Any]
    queue: str
    max_attempts: int
    delay: timedelta


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
        self._middleware = tuple(middleware)
        self.max_payload_bytes = max_payload_bytes
        self.max_output_bytes = max_output_bytes
        self._lane = lane
        self._queues = {q.name: q for q in queues}
        self._default_queue = next(q.name for q in queues if q.default)
        self._tasks = {t.id: t for t in tasks}
        self._schedules = [self._schedule_entry(s) for s in schedules]
        # the checked plan of each task's triggers with default options (see _plan)
        self._default_plans: dict[Task[Any, Any] | str, _Plan] = {}
        self._retention = retention
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._owned: list[Worker | Services] = []
        # wait_for_run's wake-ups, made by the first wait (False: not made yet)
        self._run_ends: RunEndWatcher | bool | None = False
        self._connect()

    def _connect(self) -> None:
        """A fresh storage (and what reads through it) for a new or reopened runtime."""
        storage = self._lane.create_storage()
        self._storage = storage
        # a service's start waits for the database; close() ends the wait
        self._database_wait = DatabaseWait(self._ensure_started, storage, self._closed_error)
        # concurrent get_run calls share one query (see _reads.py)
        self._point_reads: PointReads[uuid.UUID, RunSnapshot] = PointReads(
            lambda ids: storage.run_get_many(self.environment, ids)
        )
        lane = self._lane
        self._scope = MaintenanceScope(
            storage=storage,
            environment=self.environment,
            tasks=self._tasks,
            schedules=self._schedules,
            retention=self._retention,
            recover_delivery=lambda env, limits, fence: lane.recover_delivery(
                storage, env, limits, fence
            ),
        )

    def _schedule_entry(self, sched: Schedule) -> ScheduleEntry:
        if not isinstance(sched, Schedule):
            raise ConfigurationError(
                f"schedules takes schedule(...) definitions, got {shown(sched)}"
            )
        try:
            task = self._resolve_task(sched.task)
        except TaskNotFound as exc:
            raise ConfigurationError(
                f"schedule {sched.id!r} runs task {sched.task.id!r}, which is not registered: "
                "add it to create_runlane(tasks=[...])"
            ) from exc
        try:
            payload = encode_payload(task.id, task.schema, sched.payload, self.max_payload_bytes)
        except PayloadValidationError as exc:
            raise ConfigurationError(f"schedule {sched.id!r}: {exc}") from exc
        return ScheduleEntry(
            schedule=sched,
            queue=self._resolve_queue(task, sched.queue),
            payload=payload,
            max_attempts=task.retry.max_attempts,
        )

    def wrap_attempts(self, middleware: object) -> None:
        """Enter ``middleware`` outermost around the attempts of every worker (and drain)
        made from now on: how an integration (the Flask extension's app context) adds its
        own to those given to ``create_runlane``. For runlane's integrations; an application
        passes ``middleware=`` to ``create_runlane``."""
        (checked,) = check_middleware([middleware])
        with self._lock:
            self._middleware = (checked, *self._middleware)

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
        with self._lock:
            if self._closed:
                self._connect()
                self._closed = False
            self._open_locked()

    def _open_locked(self) -> None:
        """Open the storage and prepare the lane once; the caller holds the lock."""
        if self._started:
            return
        self._storage.open()
        self._lane.prepare(self._storage, self.environment)
        self._started = True
        _telemetry.register_runtime(self)  # its queue depths, while it is open

    def close(self, timeout: float | None = None) -> None:
        """Close the workers and services this runtime created (each asked to stop, their
        unfinished runs handed back), then flush and close connections, within ``timeout``
        seconds plus a small constant; idempotent."""
        limit = as_wait_timeout("timeout", timeout)
        deadline = None if limit is None else time.monotonic() + limit
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._started = False
            _telemetry.unregister_runtime(self)
            owned, self._owned = self._owned, []
            run_ends, self._run_ends = self._run_ends, False
        self._database_wait.end()
        # every part runs even when one raises; the first error is raised at the end
        closing = Closing(f"the runtime of environment {self.environment!r}")
        for item in owned:
            if isinstance(item, Worker):
                with closing.part(item.name):
                    item.stop_acquiring()  # first everywhere: none takes another's hand-back
        for item in owned:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            with closing.part(item.name):
                item.close(remaining)
        if not isinstance(run_ends, bool) and run_ends is not None:
            with closing.part("its run-end listener"):
                run_ends.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with closing.part("its connections"):
            self._storage.close(None if deadline is None else max(0.0, deadline - time.monotonic()))
        closing.raise_first()

    def _own(self, item: Worker | Services) -> None:
        """Register a worker or services for close(); refuses once closed."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            self._owned = [o for o in self._owned if not o.closed]
            self._owned.append(item)

    def _disown(self, item: Worker | Services) -> None:
        with self._lock:
            if item in self._owned:
                self._owned.remove(item)

    def _closed_error(self) -> RunlaneClosed:
        return RunlaneClosed(
            f"this Runlane (environment {self.environment!r}) was closed: call start() to "
            "open it again, or build a new runtime with create_runlane()"
        )

    def __enter__(self) -> Runlane:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _ensure_started(self) -> None:
        if self._closed:
            raise self._closed_error()
        if not self._started:
            with self._lock:
                if self._closed:
                    raise self._closed_error()
                self._open_locked()

    def _check_open(self) -> None:
        if self._closed:
            raise self._closed_error()

    def opened_storage(self) -> Storage:
        """This runtime's storage, started as every operator method starts it (a closed
        runtime raises :class:`~runlane.RunlaneClosed`). For runlane's own parts that read
        through the storage (the console); applications use the methods above."""
        self._check_open()
        self._ensure_started()
        return self._storage

    # -- producing -----------------------------------------------------------------------

    def _resolve_task(self, task: Task[Any, Any] | str) -> Task[Any, Any]:
        task_id = task if isinstance(task, str) else getattr(task, "id", None)
        registered = self._tasks.get(task_id) if isinstance(task_id, str) else None
        if registered is None or (isinstance(task, Task) and registered is not task):
            raise TaskNotFound(
                f"task {shown(task_id or task)} is not registered with this runtime: pass it in "
                f"create_runlane(tasks=[...]) (registered: {sorted(self._tasks) or 'none'})"
            )
        return registered

    def _resolve_queue(self, task: Task[Any, Any], queue: str | None) -> str:
        if queue is not None and not isinstance(queue, str):
            raise ConfigurationError(
                f"queue must be a queue name (a string) or None, got {type(queue).__name__} "
                f"{shown(queue)}"
            )
        name = queue if queue is not None else task.queue or self._default_queue
        if name not in self._queues:
            raise ConfigurationError(
                f"queue {shown(name)} is not registered with this runtime: pass "
                f"queue({shown(name)}) in create_runlane(queues=[...]) (registered: "
                f"{sorted(self._queues)})"
            )
        return name

    def _plan(self, task: Task[Any, Any] | str, options: TriggerOptions) -> _Plan:
        """``options`` checked for runs of ``task``: its task, queue, attempts and due time.

        A call with every option at its default gets the plan its task's first such call
        made (the checks depend on nothing else), so the common trigger checks nothing
        twice; anything else is checked on every call."""
        if options is DEFAULT_OPTIONS:
            try:
                plan = self._default_plans.get(task)
            except TypeError:  # an unhashable "task": the checks below refuse it
                plan = None
            if plan is not None:
                return plan
        resolved = self._resolve_task(task)
        queue_name = self._resolve_queue(resolved, options.queue)
        check_run_key(self._queues[queue_name], options.concurrency_key)
        delay_delta = as_duration("delay", options.delay)
        if options.run_at is not None:
            if options.delay is not None:
                raise ConfigurationError("pass either delay or run_at, not both")
            as_run_at(options.run_at)
        as_int32("priority", options.priority)
        attempts = (
            resolved.retry.max_attempts if options.max_attempts is None else options.max_attempts
        )
        as_int32("max_attempts", attempts, minimum=1)
        plan = _Plan(resolved, queue_name, attempts, delay_delta)
        # kept for the registered task itself and its id only: the map stays as small as the
        # catalog (another object naming a registered id is checked each time)
        if options is DEFAULT_OPTIONS and (task is resolved or type(task) is str):
            self._default_plans[task] = plan
        return plan

    def _new_runs(
        self,
        task: Task[Any, Any] | str,
        payloads: Iterable[Any],
        idempotency_keys: Sequence[str | None] | None,
        options: TriggerOptions,
        *,
        batch: bool = False,
    ) -> NewRuns:
        plan = self._plan(task, options)
        resolved = plan.task
        limit = self.max_payload_bytes
        encoded: list[str]
        if batch:
            encoded = []
            for index, payload in enumerate(payloads):
                try:
                    encoded.append(encode_payload(resolved.id, resolved.schema, payload, limit))
                except PayloadValidationError as exc:
                    raise PayloadValidationError(
                        resolved.id,
                        [f"payloads[{index}] (nothing was written): {p}" for p in exc.problems],
                    ) from exc
        else:
            encoded = [encode_payload(resolved.id, resolved.schema, p, limit) for p in payloads]
        keys: list[str | None]
        if idempotency_keys is None:
            keys = [None] * len(encoded)
        else:
            if isinstance(idempotency_keys, str | bytes):
                raise ConfigurationError(
                    "idempotency_keys takes one key (or None) per payload, got a single string"
                )
            keys = list(idempotency_keys)
            if len(keys) != len(encoded):
                raise ConfigurationError(
                    f"got {len(keys)} idempotency keys for {len(encoded)} payloads; "
                    "give one per payload"
                )
            for key in keys:  # a child's was checked by trigger_child, or is runlane's own
                if key is not None and options.parent_run_id is None:
                    check_idempotency_key(key)
        return NewRuns(
            environment=self.environment,
            task_id=resolved.id,
            queue=plan.queue,
            ids=new_run_ids(len(encoded)),
            payloads=encoded,
            idempotency_keys=keys,
            priority=options.priority,
            max_attempts=plan.max_attempts,
            delay=plan.delay,
            run_at=options.run_at,
            parent_run_id=options.parent_run_id,
            concurrency_key=options.concurrency_key,
        )

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
        self._check_open()
        options = call_options(
            queue=queue,
            delay=delay,
            run_at=run_at,
            priority=priority,
            max_attempts=max_attempts,
            concurrency_key=concurrency_key,
        )
        (handle,) = self._trigger(
            task,
            [payload],
            None if idempotency_key is None else [idempotency_key],
            options,
            connection,
        )
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
        self._check_open()
        options = call_options(
            queue=queue,
            delay=delay,
            run_at=run_at,
            priority=priority,
            max_attempts=max_attempts,
            concurrency_key=concurrency_key,
        )
        return self._trigger(
            task, as_payload_list(payloads), idempotency_keys, options, connection, batch=True
        )

    def _trigger(
        self,
        task: Task[Any, Any] | str,
        payloads: list[Any],
        idempotency_keys: Sequence[str | None] | None,
        options: TriggerOptions,
        connection: Any = None,
        *,
        batch: bool = False,
    ) -> list[RunHandle]:
        runs = self._new_runs(task, payloads, idempotency_keys, options, batch=batch)
        if not runs.ids:
            return []
        self._ensure_started()
        inserted = _telemetry.trigger(
            runs, lambda batch: self._storage.run_insert_many(batch, connection=connection)
        )
        return [
            RunHandle(id=row.id, task_id=runs.task_id, queue=row.queue, created=row.created)
            for row in inserted
        ]

    # -- reading -------------------------------------------------------------------------

    def get_run(self, run_id: uuid.UUID | str) -> RunSnapshot:
        """The run's current state; raises RunNotFound when this environment has no such run.
        Concurrent calls from several threads are answered by one batched query."""
        self._check_open()
        key = run_key(run_id)
        self._ensure_started()
        snapshot = self._point_reads.get(key)
        if snapshot is None:
            raise RunNotFound(
                f"no run {key} in environment {self.environment!r}; it was never triggered "
                "here, its trigger's transaction did not commit, or it was pruned"
            )
        return snapshot

    def wait_for_run(
        self, run_id: uuid.UUID | str, timeout: timedelta | float | None = None
    ) -> RunSnapshot:
        """Block until the run is terminal and return it; raises TimeoutError after
        ``timeout``. Wakes when the run's end is announced (LISTEN/NOTIFY on the schema's
        ends channel, one listener per runtime while someone waits); looks again every
        second in case an announcement was lost, and polls with a capped backoff (10 ms
        growing to 250 ms) while the listener is not connected or the lane announces
        nothing (``listen=False``)."""
        self._check_open()
        limit = None if timeout is None else as_duration("timeout", timeout).total_seconds()
        deadline = None if limit is None else time.monotonic() + limit
        key = run_key(run_id)
        snapshot = self.get_run(key)  # RunNotFound before any listener is started
        if snapshot.is_terminal:
            return snapshot
        watcher = self._end_watcher()
        if watcher is None:
            return self._poll_for_run(key, snapshot, deadline, timeout)
        with watcher.watch(key) as ended:
            pause = 0.01
            while True:
                ended.clear()
                snapshot = self.get_run(key)
                if snapshot.is_terminal:
                    return snapshot
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"run {snapshot.id} is still {snapshot.status} after {timeout}"
                    )
                wait = _ENDS_FALLBACK_POLL_SECONDS if watcher.connected else pause
                pause = min(pause * 2, 0.25)
                ended.wait(wait if remaining is None else min(wait, remaining))

    def _poll_for_run(
        self,
        key: uuid.UUID,
        snapshot: RunSnapshot,
        deadline: float | None,
        timeout: timedelta | float | None,
    ) -> RunSnapshot:
        pause = 0.01
        while not snapshot.is_terminal:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {snapshot.id} is still {snapshot.status} after {timeout}")
            wait = pause if deadline is None else min(pause, max(0.0, deadline - time.monotonic()))
            time.sleep(wait)
            pause = min(pause * 2, 0.25)
            snapshot = self.get_run(key)
        return snapshot

    def _end_watcher(self) -> RunEndWatcher | None:
        """The runtime's run-end wake-ups, made on first use; None when the lane has none."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if isinstance(self._run_ends, bool):
                self._run_ends = self._lane.watch_run_ends(
                    self.environment, f"runlane-run-ends-{next(_end_watchers)}"
                )
            return self._run_ends

    def cancel(self, run_id: uuid.UUID | str) -> CancelResult:
        """Cancel a run: queued, retrying, released and waiting runs are cancelled at once; a
        running run becomes ``cancellation_requested``, its handler's ``context.cancelled``
        is set (NOTIFY, or its next lease extension), and it ends ``cancelled`` when the
        handler stops (raises, suspends) or its lease lapses; a handler that returns
        normally has completed its run. Cancelling a terminal run changes nothing and says so
        (``changed=False``)."""
        self._check_open()
        key = run_key(run_id)
        self._ensure_started()
        answer = self._storage.run_cancel(self.environment, key)
        if answer is None:
            raise RunNotFound(f"no run {key} in environment {self.environment!r}")
        previous, current = answer
        return CancelResult(
            run_id=key, previous=previous, status=current, changed=previous != current
        )

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
        self._check_open()
        query = list_query(
            self.environment, status=status, task=task, queue=queue, limit=limit, cursor=cursor
        )
        self._ensure_started()
        return run_page(self._storage.run_list(query), query.limit - 1)

    def get_run_history(self, run_id: uuid.UUID | str) -> RunHistory:
        """The run with its finished attempts (number, outcome, error, start and end) in
        order and its stored steps, read in one snapshot; raises RunNotFound."""
        self._check_open()
        key = run_key(run_id)
        self._ensure_started()
        history = self._storage.run_history(self.environment, key)
        if history is None:
            raise RunNotFound(f"no run {key} in environment {self.environment!r}")
        return history

    def retry_run(self, run_id: uuid.UUID | str) -> RunSnapshot:
        """Queue a ``failed`` or ``cancelled`` run again, due now, with a fresh attempt
        budget (``max_attempts`` more attempts); its attempt numbers keep growing, its
        attempts history and stored steps are kept, its error and output are cleared. Any
        other status raises RunStateConflict saying what to do instead; an unknown run
        raises RunNotFound. Returns the run as queued."""
        self._check_open()
        key = run_key(run_id)
        self._ensure_started()
        outcome = self._storage.run_retry(self.environment, key)
        if outcome.previous is None:
            raise RunNotFound(f"no run {key} in environment {self.environment!r}")
        if not outcome.retried:
            raise retry_conflict(key, self.environment, outcome.previous, outcome.pruned)
        if outcome.run is not None:  # read in the retry's transaction
            return outcome.run
        # a storage that does not read it back: the run as it is now
        snapshot = self._storage.run_get(self.environment, key)
        if snapshot is None:  # pruned in between: it was queued, so cleanup cannot take it
            raise RunNotFound(f"run {key} disappeared from environment {self.environment!r}")
        return snapshot

    # -- bulk actions --------------------------------------------------------------------

    def _bulk(self, action: str, filters: BulkFilters) -> BulkResult:
        self._check_open()
        runs, limit = bulk_filter(action, self.environment, filters)
        self._ensure_started()
        return bulk_action(self._storage, action, runs, limit, filters)

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
        return self._bulk("retry", filters)

    def cancel_runs(self, **filters: Unpack[BulkFilters]) -> BulkResult:
        """``cancel`` for every queued, retrying, released, waiting or running run the
        filters match (running ones become ``cancellation_requested`` and end cancelled
        when their handlers stop); filters, batches and ``on_batch`` as ``retry_runs``."""
        return self._bulk("cancel", filters)

    def delete_runs(self, **filters: Unpack[BulkFilters]) -> BulkResult:
        """Delete the terminal runs (completed, failed, cancelled) the filters match, with
        their attempts and steps, as cleanup does: a run that still has children becomes a
        tombstone counting them (cleanup deletes it once they are gone). A non-terminal
        ``status`` raises ConfigurationError, nothing deleted. Filters, batches and
        ``on_batch`` as ``retry_runs``."""
        return self._bulk("delete", filters)

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
        self._check_open()
        self._ensure_started()
        return _queue_admin.pause_queue(self._storage, self.environment, self._queues, name, reason)

    def resume_queue(self, name: str) -> bool:
        """Resume a paused queue: idle workers serving it are woken at once (NOTIFY; their
        poll is the fallback), and on a transport lane its queued runs are published again.
        Idempotent (resuming a running queue changes nothing, and re-publishes what a resume
        interrupted part way left unpublished). Unknown queues as for ``pause_queue``.
        Returns True when the queue was paused."""
        self._check_open()
        self._ensure_started()
        return _queue_admin.resume_queue(self._storage, self.environment, self._queues, name)

    def list_queues(self) -> list[QueueInfo]:
        """Every queue this runtime defines and every queue the database knows in this
        environment (unfinished runs, or a pause row; ``defined=False``), by name: paused
        state, limits, unfinished runs by status and the age of the oldest due queued run
        (database time). Index-served: terminal runs are not counted."""
        self._check_open()
        self._ensure_started()
        return _queue_admin.list_queues(self._storage, self.environment, self._queues)

    # -- workers -------------------------------------------------------------------------

    def list_workers(self, *, include_stopped: bool = False) -> list[WorkerInfo]:
        """The delivery workers of this environment, on every host and lane, oldest first:
        id, host, pid, runlane version, queues, concurrency, start, last heartbeat and
        state. A running or stopping worker unseen for three heartbeat intervals (database
        time: it crashed, froze, or lost the database) is ``lost``; stopped workers only with
        ``include_stopped``. Cleanup removes stopped and lost rows after
        ``RetentionPolicy.workers``."""
        self._check_open()
        self._ensure_started()
        return _workers.list_workers(self._storage, self.environment, include_stopped)

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
        self._check_open()
        self._ensure_started()
        return _schedule_admin.list_schedules(self._storage, self.environment, self._schedules)

    def pause_schedule(self, id: str) -> bool:
        """Pause schedule ``id`` in this environment: from the moment the pause commits no
        maintenance replica fires it (a slot being fired at that moment finishes first), until
        ``resume_schedule``. Durable (stored in Postgres) and idempotent; a run it already
        created is not touched. Returns True when it was not paused before. An id no
        schedule has (stored, or defined by this runtime) raises ConfigurationError; list
        them with ``runlane schedules list``."""
        self._check_open()
        self._ensure_started()
        return _schedule_admin.pause_schedule(self._storage, self.environment, self._schedules, id)

    def resume_schedule(self, id: str) -> bool:
        """Resume a paused schedule: it awaits the first slot after the database's time of
        the resume; the slots it missed while paused are not caught up (whatever its
        ``catch_up``). Idempotent (resuming a schedule that is not paused changes nothing).
        Returns True when it was paused. Unknown ids as for ``pause_schedule``."""
        self._check_open()
        self._ensure_started()
        return _schedule_admin.resume_schedule(self._storage, self.environment, self._schedules, id)

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
        self._check_open()
        self._ensure_started()
        return _schedule_admin.trigger_schedule_now(
            self._storage, self.environment, self._schedules, id, idempotency_key
        )

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
        self._check_open()
        delta = None if timeout is None else as_duration("timeout", timeout)
        if idempotency_key is not None:
            check_idempotency_key(idempotency_key)
        self._ensure_started()
        return self._storage.wait_token_create(
            self.environment, new_run_id(), delta, idempotency_key
        )

    def get_wait_token(self, token_id: uuid.UUID | str) -> WaitToken:
        self._check_open()
        key = token_key(token_id)
        self._ensure_started()
        token = self._storage.wait_token_get(self.environment, key)
        if token is None:
            raise WaitTokenNotFound(f"no wait token {key} in environment {self.environment!r}")
        return token

    def complete_wait_token(self, token_id: uuid.UUID | str, output: Any = None) -> WaitToken:
        """Complete a pending token with ``output`` and return its state. Completing a token
        that is already completed or timed out changes nothing and returns its state.

        The completion commits first; then one small pass resumes the runs waiting on the
        token. If that pass fails the completion still stands and maintenance resumes them.
        """
        self._check_open()
        key = token_key(token_id)
        try:
            encoded = encode_output(output, self.max_output_bytes, what="the wait token's output")
        except OutputNotSerializable as exc:
            raise ConfigurationError(f"{exc}; nothing was written") from exc
        self._ensure_started()
        if self._storage.wait_token_complete(self.environment, key, encoded):
            try:
                self._storage.run_resume_waiters(
                    self.environment, _EAGER_RESUME_LIMIT, token_ids=[key], run_ids=[]
                )
            except Exception:
                log.warning(
                    "runlane: resuming runs waiting on token %s failed; the completion stands "
                    "and maintenance will resume them",
                    key,
                    exc_info=True,
                )
        return self.get_wait_token(key)

    # -- executing -----------------------------------------------------------------------

    def _queue_filter(self, queues: Sequence[str] | None) -> list[str]:
        if queues is None:
            return sorted(self._queues)
        if isinstance(queues, str):
            raise ConfigurationError(f"queues takes a list of names, got {shown(queues)}")
        unknown = sorted(set(queues) - set(self._queues))
        if unknown:
            raise ConfigurationError(
                f"unknown queues {unknown}: register them with create_runlane(queues=[...]) "
                f"(registered: {sorted(self._queues)})"
            )
        if not queues:
            raise ConfigurationError("queues must name at least one queue, or be None for all")
        return list(queues)

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
        self._check_open()
        if max_runs is not None:
            as_int("max_runs", max_runs, 0)
        names = self._queue_filter(queues)
        unsupported = self._lane.drain_unsupported
        if unsupported is not None:
            raise ConfigurationError(
                f"drain() is not available on the {self._lane.name} lane: {unsupported}"
            )
        if max_runs == 0:
            return DrainResult(runs_executed=0)
        self._ensure_started()
        worker = self._new_worker(
            [self._queues[n] for n in names],
            WorkerOptions(
                concurrency=1, lease=self._lane.lease_duration, claim_batch=1, drain=True
            ),
        )
        worker.start()

        def result() -> DrainResult:
            kinds = worker.outcomes
            return DrainResult(
                runs_executed=worker.runs_executed,
                completed=kinds.get("completed", 0),
                failed=kinds.get("failed", 0),
                retried=kinds.get("retried", 0),
            )

        progress = None if on_progress is None else lambda: on_progress(result())
        worker.run_inline(max_runs, stop, progress)
        return result()

    def _new_worker(self, queues: list[Queue], options: WorkerOptions) -> Worker:
        worker = Worker(
            storage=self._storage,
            environment=self.environment,
            tasks=self._tasks,
            queues=queues,
            options=options,
            lane=self._lane,
            make_backend=lambda storage: Backend(
                storage, trigger=self._trigger, max_output_bytes=self.max_output_bytes
            ),
            on_closed=self._disown,
            middleware=self._middleware,
        )
        self._own(worker)
        return worker

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
        self._check_open()
        polled = check_worker_arguments(concurrency, queues, self._queues)
        batch = _default_claim_batch(concurrency) if claim_batch is None else claim_batch
        as_int("claim_batch", batch, 1, MAX_CLAIM_BATCH)
        self._database_wait.until_ready(wait_for_database, "starting a worker")
        worker = self._new_worker(
            polled,
            WorkerOptions(
                concurrency=concurrency,
                lease=self._lane.lease_duration,
                claim_batch=batch,
                prefetch=max(0, batch - concurrency),
            ),
        )
        try:
            worker.start()
        except RuntimeError as exc:  # "can't start new thread": the process is out of them
            # the slots already started would run on unowned: stop them and hand back what
            # they claimed (a close error is logged; the thread limit is the news)
            try:
                worker.close(_START_FAILED_CLOSE_SECONDS)
            except Exception:
                log.warning("runlane: closing %s failed", worker.name, exc_info=True)
            raise WorkerFailed(
                f"{worker.name} could not start its {concurrency} threads ({exc}): the "
                "process is out of threads; lower concurrency, or raise the limit on threads "
                "(ulimit -u, the container's pids limit)"
            ) from exc
        return worker

    # -- maintenance ---------------------------------------------------------------------

    def run_maintenance_once(self, limits: MaintenanceLimits | None = None) -> MaintenanceResult:
        """One bounded maintenance pass for this environment, every phase of
        ``MaintenancePhase`` in order; the first failure propagates."""
        self._check_open()
        if limits is None:
            limits = MaintenanceLimits()
        elif not isinstance(limits, MaintenanceLimits):
            raise ConfigurationError(f"limits must be MaintenanceLimits, got {shown(limits)}")
        self._ensure_started()
        return run_maintenance_pass(self._scope, limits)

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
        self._check_open()
        if limits is not None and not isinstance(limits, MaintenanceLimits):
            raise ConfigurationError(f"limits must be MaintenanceLimits, got {shown(limits)}")
        as_timedelta("lease_duration", lease_duration, MIN_LEASE, MAX_LEASE)
        self._database_wait.until_ready(wait_for_database, "starting the maintenance services")
        services = Services(
            self._scope,
            limits=limits or MaintenanceLimits(),
            lease=lease_duration,
            on_service_error=on_service_error,
        )
        self._own(services)
        services.start()
        return services

    def status(self) -> StatusReport:
        """The progress signals an operator should alert on (see StatusReport)."""
        self._check_open()
        self._ensure_started()
        counts = self._storage.status_counts(self.environment)
        lane = self._lane.status(self._storage, self.environment)
        leases = self._storage.maintenance_lease_list(self.environment)
        return StatusReport(
            environment=self.environment,
            lane=lane,
            queues=_telemetry.queue_statuses(counts.pop("queues", ()), self._queues),
            maintenance_leases=tuple(
                MaintenanceLeaseStatus(r.band, r.owner, r.fencing, r.expires_at, r.live)
                for r in leases
            ),
            late_schedules=_schedule_admin.late_schedules(self._storage, self.environment),
            **counts,
        )


def _default_claim_batch(concurrency: int) -> int:
    """Twelve runs a slot: with short handlers one claim feeds the slots for about 240 ms.
    Measured (20,000 no-op runs, concurrency 8, 2 cores): 12.1k runs/s at 32 a claim, 13.9k
    at 96; larger claims gain little more and hold more leases ahead."""
    return min(12 * concurrency, 500)


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
    check_name("environment", environment)
    checked_middleware = check_middleware(middleware)
    check_limit("max_payload_bytes", max_payload_bytes)
    check_limit("max_output_bytes", max_output_bytes)
    if retention is not None and not isinstance(retention, RetentionPolicy):
        raise ConfigurationError(f"retention must be a RetentionPolicy, got {shown(retention)}")
    schedule_ids = [getattr(s, "id", s) for s in schedules]
    repeated = sorted({str(i) for i in schedule_ids if schedule_ids.count(i) > 1})
    if repeated:
        raise ConfigurationError(f"schedules registered twice: {repeated}")
    queue_list = with_default_queue(queues)
    registered = {q.name for q in queue_list}
    task_ids: set[str] = set()
    for t in tasks:
        if not isinstance(t, Task):
            raise ConfigurationError(f"tasks takes @task-decorated functions, got {shown(t)}")
        if t.id in task_ids:
            raise ConfigurationError(f"two tasks share the id {t.id!r}")
        task_ids.add(t.id)
        if t.queue is not None and t.queue not in registered:
            raise ConfigurationError(
                f"task {t.id!r} names queue {t.queue!r}, which is not registered: add "
                f"queue({t.queue!r}) to create_runlane(queues=[...])"
            )
    # a lane whose transport limits names (RabbitMQ's 255-byte queue names) refuses them here
    check_queue_names = getattr(lane, "check_queue_names", None)
    if callable(check_queue_names):
        check_queue_names(environment, [q.name for q in queue_list])
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
