"""The runtime's reads: runs by id, pages of runs, a run's history, the workers, and
``status()``.

Concurrent point reads share a query, and no thread waits for a timer: the first caller of
a quiet batcher becomes the leader and reads what is pending at once; callers arriving
meanwhile queue up, and when the leader's read is done one of them leads the next read for
the whole queue. A single caller therefore pays one round trip as usual, while N concurrent
callers pay about two queries instead of N.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import attrs

from runlane import _telemetry
from runlane._operator import workers as _workers
from runlane._operator.runs import list_query, run_page, search_page, search_seconds
from runlane._validation import run_key
from runlane.errors import RunNotFound
from runlane.lanes import Lane
from runlane.models import (
    MaintenanceLeaseStatus,
    RunHistory,
    RunPage,
    RunSnapshot,
    RunStatus,
    StatusReport,
    WorkerInfo,
)
from runlane.runtime import _schedule_admin
from runlane.runtime._backend import Opened
from runlane.storage import Storage
from runlane.tasks import Queue, Task

__all__ = ["PointReads", "Reads"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Waiter(Generic[V]):
    __slots__ = ("error", "event", "lead", "result")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.lead = False
        self.result: V | None = None
        self.error: BaseException | None = None

    def outcome(self) -> V | None:
        if self.error is not None:
            raise self.error
        return self.result


class PointReads(Generic[K, V]):
    """Reads by key through ``fetch_many``, merging the reads of concurrent callers."""

    def __init__(self, fetch_many: Callable[[Sequence[K]], dict[K, V]]) -> None:
        self._fetch_many = fetch_many
        self._lock = threading.Lock()
        self._pending: dict[K, list[_Waiter[V]]] = {}
        self._leading = False
        self.queries = 0  # how many reads were made, for tests and metrics

    def get(self, key: K) -> V | None:
        waiter: _Waiter[V] = _Waiter()
        with self._lock:
            self._pending.setdefault(key, []).append(waiter)
            if not self._leading:
                self._leading = waiter.lead = True
        if not waiter.lead:
            waiter.event.wait()
            if not waiter.lead:
                return waiter.outcome()
        self._lead(waiter)
        return waiter.outcome()

    def _lead(self, me: _Waiter[V]) -> None:
        with self._lock:
            batch, self._pending = self._pending, {}
            self.queries += 1
        try:
            found = self._fetch_many(list(batch))
        except BaseException as exc:
            for waiters in batch.values():
                for waiter in waiters:
                    waiter.error = exc
        else:
            for key, waiters in batch.items():
                for waiter in waiters:
                    waiter.result = found.get(key)
        with self._lock:
            if self._pending:
                # the next read is led by one of the callers that queued meanwhile
                successor = next(iter(self._pending.values()))[0]
                successor.lead = True
                successor.event.set()
            else:
                self._leading = False
        for waiters in batch.values():
            for waiter in waiters:
                if waiter is not me:
                    waiter.event.set()


@attrs.define(eq=False)
class Reads:
    """The runtime's reads: runs by id (concurrent ones batched), pages, histories, the
    workers and the status report, through the storage ``opened()`` returns."""

    _environment: str
    _lane: Lane
    _queues: Mapping[str, Queue]
    _opened: Opened
    point_reads: PointReads[uuid.UUID, RunSnapshot] = attrs.field(init=False)

    def connect(self, storage: Storage) -> None:
        """Batch point reads on ``storage``: a new or reopened runtime's."""
        environment = self._environment
        self.point_reads = PointReads(lambda ids: storage.run_get_many(environment, ids))

    def run(self, run_id: uuid.UUID | str) -> RunSnapshot:
        key = run_key(run_id)
        self._opened()
        snapshot = self.point_reads.get(key)
        if snapshot is None:
            raise RunNotFound(
                f"no run {key} in environment {self._environment!r}; it was never triggered "
                "here, its trigger's transaction did not commit, or it was pruned"
            )
        return snapshot

    def runs(
        self,
        status: RunStatus | str | None,
        task: Task[Any, Any] | str | None,
        queue: str | None,
        limit: int,
        cursor: str | None,
        *,
        search: Mapping[str, Any] | None = None,
    ) -> RunPage:
        """A page of runs; ``search`` (task_prefix, queue_prefix, idempotency_key,
        payload_contains, search_seconds) makes it a search within a time budget."""
        found = dict(search or {})
        seconds = search_seconds(found.pop("search_seconds", 1.0))
        query = list_query(
            self._environment,
            status=status,
            task=task,
            queue=queue,
            limit=limit,
            cursor=cursor,
            **found,
        )
        if query.searching:
            return search_page(self._opened().web_run_search(query, seconds), query.limit - 1)
        return run_page(self._opened().run_list(query), query.limit - 1)

    def history(self, run_id: uuid.UUID | str) -> RunHistory:
        key = run_key(run_id)
        history = self._opened().run_history(self._environment, key)
        if history is None:
            raise RunNotFound(f"no run {key} in environment {self._environment!r}")
        return history

    def workers(self, include_stopped: bool) -> list[WorkerInfo]:
        return _workers.list_workers(self._opened(), self._environment, include_stopped)

    def status(self) -> StatusReport:
        storage = self._opened()
        counts = storage.status_counts(self._environment)
        lane = self._lane.status(storage, self._environment)
        leases = storage.maintenance_lease_list(self._environment)
        return StatusReport(
            environment=self._environment,
            lane=lane,
            queues=_telemetry.queue_statuses(counts.pop("queues", ()), self._queues),
            maintenance_leases=tuple(
                MaintenanceLeaseStatus(r.band, r.owner, r.fencing, r.expires_at, r.live)
                for r in leases
            ),
            late_schedules=_schedule_admin.late_schedules(storage, self._environment),
            **counts,
        )
