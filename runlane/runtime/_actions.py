"""The operator's actions on runs: cancel, retry and the bulk actions (queues' and
schedules' are in ``_queue_admin.py`` and ``_schedule_admin.py``)."""

from __future__ import annotations

import uuid

import attrs

from runlane._operator.bulk import BulkFilters, bulk_action, bulk_filter
from runlane._operator.runs import retry_conflict
from runlane._validation import run_key
from runlane.errors import RunNotFound
from runlane.models import BulkResult, CancelResult, RunSnapshot
from runlane.runtime._backend import Opened

__all__ = ["RunActions"]


@attrs.define(eq=False)
class RunActions:
    """Each action through the storage ``opened()`` returns, in one environment."""

    _environment: str
    _opened: Opened

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
