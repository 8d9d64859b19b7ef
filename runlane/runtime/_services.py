"""What a runtime starts: workers (``drain``'s in the caller's thread, delivery workers in
their own), and maintenance (one pass, or the services running passes in the background).
The runtime owns each worker and service started here and closes them first."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import attrs

from runlane._limits import MAX_CLAIM_BATCH, MAX_LEASE, MIN_LEASE
from runlane.errors import ConfigurationError, WorkerFailed
from runlane.lanes import Lane
from runlane.maintenance import (
    MaintenanceLimits,
    MaintenanceResult,
    MaintenanceScope,
    RetentionPolicy,
    ScheduleEntry,
    ServiceErrorCallback,
    Services,
    run_maintenance_pass,
)
from runlane.models import DrainResult
from runlane.runtime._backend import Backend, TriggerRuns
from runlane.runtime._lifetime import Lifetime
from runlane.storage import Storage
from runlane.tasks import Queue, Task
from runlane.toolkit import as_int, as_timedelta, shown
from runlane.worker import Middleware, Worker, WorkerOptions, check_worker_arguments

__all__ = ["ServiceStarts"]

log = logging.getLogger("runlane")

# a worker whose threads could not all start: what its started slots get to stop
_START_FAILED_CLOSE_SECONDS = 10.0


@attrs.define(eq=False, kw_only=True)
class ServiceStarts:
    """Starts workers and maintenance on the runtime's storage, each owned by its lifetime
    (closed by its close, refused once it is closed)."""

    _environment: str
    _lane: Lane
    _tasks: dict[str, Task[Any, Any]]
    _queues: dict[str, Queue]
    _schedules: Sequence[ScheduleEntry]
    _retention: RetentionPolicy
    _middleware: tuple[Middleware, ...]
    _max_output_bytes: int
    _trigger: TriggerRuns
    _life: Lifetime
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _scope: MaintenanceScope = attrs.field(init=False)

    def connect(self, storage: Storage) -> None:
        """Maintain through ``storage``: a new or reopened runtime's."""
        lane = self._lane
        self._scope = MaintenanceScope(
            storage=storage,
            environment=self._environment,
            tasks=self._tasks,
            schedules=self._schedules,
            retention=self._retention,
            recover_delivery=lambda env, limits, fence: lane.recover_delivery(
                storage, env, limits, fence
            ),
        )

    def wrap_attempts(self, middleware: Middleware) -> None:
        with self._lock:
            self._middleware = (middleware, *self._middleware)

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
        max_runs: int | None,
        queues: Sequence[str] | None,
        stop: threading.Event | None,
        on_progress: Callable[[DrainResult], None] | None,
    ) -> DrainResult:
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
        self._life.opened()
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
        max_output_bytes = self._max_output_bytes
        worker = Worker(
            storage=self._life.opened(),
            environment=self._environment,
            tasks=self._tasks,
            queues=queues,
            options=options,
            lane=self._lane,
            make_backend=lambda storage: Backend(
                storage, trigger=self._trigger, max_output_bytes=max_output_bytes
            ),
            on_closed=self._life.disown,
            middleware=self._middleware,
        )
        self._life.own(worker)
        return worker

    def delivery_worker(
        self,
        concurrency: int,
        queues: Sequence[str | Queue] | None,
        claim_batch: int | None,
        wait_for_database: float | None,
    ) -> Worker:
        polled = check_worker_arguments(concurrency, queues, self._queues)
        batch = _default_claim_batch(concurrency) if claim_batch is None else claim_batch
        as_int("claim_batch", batch, 1, MAX_CLAIM_BATCH)
        self._life.wait_for_database(wait_for_database, "starting a worker")
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

    def maintenance_once(self, limits: MaintenanceLimits | None) -> MaintenanceResult:
        if limits is None:
            limits = MaintenanceLimits()
        elif not isinstance(limits, MaintenanceLimits):
            raise ConfigurationError(f"limits must be MaintenanceLimits, got {shown(limits)}")
        self._life.opened()
        return run_maintenance_pass(self._scope, limits)

    def services(
        self,
        on_service_error: ServiceErrorCallback | None,
        limits: MaintenanceLimits | None,
        lease_duration: timedelta,
        wait_for_database: float | None,
    ) -> Services:
        if limits is not None and not isinstance(limits, MaintenanceLimits):
            raise ConfigurationError(f"limits must be MaintenanceLimits, got {shown(limits)}")
        as_timedelta("lease_duration", lease_duration, MIN_LEASE, MAX_LEASE)
        self._life.wait_for_database(wait_for_database, "starting the maintenance services")
        services = Services(
            self._scope,
            limits=limits or MaintenanceLimits(),
            lease=lease_duration,
            on_service_error=on_service_error,
        )
        self._life.own(services)
        services.start()
        return services


def _default_claim_batch(concurrency: int) -> int:
    """Twelve runs a slot: with short handlers one claim feeds the slots for about 240 ms.
    Measured (20,000 no-op runs, concurrency 8, 2 cores): 12.1k runs/s at 32 a claim, 13.9k
    at 96; larger claims gain little more and hold more leases ahead."""
    return min(12 * concurrency, 500)
