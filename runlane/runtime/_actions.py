"""The operator's actions on runs, queues and schedules: cancel, retry, the bulk actions,
pausing and resuming queues and schedules, running a schedule now."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence

from runlane._operator.bulk import BulkFilters, bulk_action, bulk_filter
from runlane._operator.runs import retry_conflict
from runlane._validation import run_key
from runlane.errors import RunNotFound
from runlane.maintenance import ScheduleEntry
from runlane.models import BulkResult, CancelResult, RunHandle, RunSnapshot
from runlane.runtime import _queue_admin, _schedule_admin
from runlane.runtime._backend import Opened
from runlane.tasks import Queue

__all__ = ["OperatorActions"]


class OperatorActions:
    """Each action through the storage ``opened()`` returns, in this runtime's environment;
    queue and schedule names are checked against the runtime's definitions and the
    database's."""

    def __init__(
        self,
        environment: str,
        queues: Mapping[str, Queue],
        schedules: Sequence[ScheduleEntry],
        opened: Opened,
    ) -> None:
        self._environment = environment
        self._queues = queues
        self._schedules = schedules
        self._opened = opened

    def cancel(self, run_id: uuid.UUID | str) -> CancelResult:
        key = run_key(run_id)
        answer = self._opened().run_cancel(self._environment, key)
        if answer is None:
            raise RunNotFound(f"no run {key} in environment {self._environment!r}")
        previous, current = answer
        return CancelResult(
            run_id=key, previous=previous, status=current, changed=previous != current
        )

    def retry(self, run_id: uuid.UUID | str) -> RunSnapshot:
        key = run_key(run_id)
        storage = self._opened()
        outcome = storage.run_retry(self._environment, key)
        if outcome.previous is None:
            raise RunNotFound(f"no run {key} in environment {self._environment!r}")
        if not outcome.retried:
            raise retry_conflict(key, self._environment, outcome.previous, outcome.pruned)
        if outcome.run is not None:  # read in the retry's transaction
            return outcome.run
        # a storage that does not read it back: the run as it is now
        snapshot = storage.run_get(self._environment, key)
        if snapshot is None:  # pruned in between: it was queued, so cleanup cannot take it
            raise RunNotFound(f"run {key} disappeared from environment {self._environment!r}")
        return snapshot

    def bulk(self, action: str, filters: BulkFilters) -> BulkResult:
        runs, limit = bulk_filter(action, self._environment, filters)
        return bulk_action(self._opened(), action, runs, limit, filters)

    def pause_queue(self, name: str, reason: str | None) -> bool:
        storage = self._opened()
        return _queue_admin.pause_queue(storage, self._environment, self._queues, name, reason)

    def resume_queue(self, name: str) -> bool:
        return _queue_admin.resume_queue(self._opened(), self._environment, self._queues, name)

    def pause_schedule(self, schedule_id: str) -> bool:
        storage = self._opened()
        return _schedule_admin.pause_schedule(
            storage, self._environment, self._schedules, schedule_id
        )

    def resume_schedule(self, schedule_id: str) -> bool:
        storage = self._opened()
        return _schedule_admin.resume_schedule(
            storage, self._environment, self._schedules, schedule_id
        )

    def trigger_schedule_now(self, schedule_id: str, idempotency_key: str | None) -> RunHandle:
        storage = self._opened()
        return _schedule_admin.trigger_schedule_now(
            storage, self._environment, self._schedules, schedule_id, idempotency_key
        )
