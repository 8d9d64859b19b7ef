"""The operator's actions on runs: cancel, retry and the bulk actions (queues' and
schedules' are in ``_queue_admin.py`` and ``_schedule_admin.py``)."""

from __future__ import annotations

import uuid

import attrs

from runlane._operator.bulk import BulkFilters, bulk_action, bulk_filter
from runlane._operator.runs import retry_conflict
from runlane._validation import run_key
from runlane.errors import RunNotFound, RunStateConflict
from runlane.models import BulkResult, CancelResult, RunSnapshot, RunStatus
from runlane.runtime._audit import AuditTrail
from runlane.runtime._backend import Opened

__all__ = ["RunActions"]


@attrs.define(eq=False)
class RunActions:
    """Each action through the storage ``opened()`` returns, in one environment."""

    _environment: str
    _opened: Opened
    _trail: AuditTrail

    def cancel(self, run_id: uuid.UUID | str, reason: object = None) -> CancelResult:
        key = run_key(run_id)
        answer = self._trail.record(
            self._trail.entry("cancel", str(key), reason, {}),
            lambda storage: storage.run_cancel(self._environment, key),
            _cancel_counted,
        )
        if answer is None:
            raise RunNotFound(f"no run {key} in environment {self._environment!r}")
        previous, current = answer
        return CancelResult(
            run_id=key, previous=previous, status=current, changed=previous != current
        )

    def retry(self, run_id: uuid.UUID | str, reason: object = None) -> RunSnapshot:
        key = run_key(run_id)
        storage = self._opened()
        outcome = self._trail.record(
            self._trail.entry("retry", str(key), reason, {}),
            lambda view: view.run_retry(self._environment, key),
            lambda done: (1, True) if done.retried else None,  # a refused retry did nothing
        )
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

    def delete(self, run_id: uuid.UUID | str, reason: object = None) -> bool:
        key = run_key(run_id)
        answer = self._trail.record(
            self._trail.entry("delete", str(key), reason, {}),
            lambda storage: storage.run_delete(self._environment, key),
            lambda found: None if found is None or not found[1] else (1, True),
        )
        if answer is None:
            raise RunNotFound(f"no run {key} in environment {self._environment!r}")
        previous, deleted = answer
        if not deleted:
            raise RunStateConflict(
                f"run {key} is {previous.value}: only a completed, failed or cancelled run "
                "can be deleted; cancel it first"
            )
        return True

    def bulk(self, action: str, filters: BulkFilters) -> BulkResult:
        reason = filters.pop("reason", None)
        runs, limit = bulk_filter(action, self._environment, filters)
        if filters.get("dry_run") is True:
            return bulk_action(self._opened(), action, runs, limit, filters)
        details = {
            "statuses": [s.value for s in runs.statuses],
            "task": runs.task_id,
            "queue": runs.queue,
            "created_after": None if runs.created_after is None else str(runs.created_after),
            "created_before": None if runs.created_before is None else str(runs.created_before),
            "limit": limit,
            "run_ids": None if runs.run_ids is None else [str(key) for key in runs.run_ids],
        }
        named = [f"{k}={v}" for k, v in details.items() if v is not None and k not in _UNNAMED]
        if runs.run_ids is not None:  # the ids are in the details, the target counts them
            named.append(f"{len(runs.run_ids)} selected runs")
        entry = self._trail.entry(f"bulk_{action}", ", ".join(named) or "all", reason, details)
        return self._trail.bulk(
            entry, lambda storage: bulk_action(storage, action, runs, limit, filters)
        )


_UNNAMED = frozenset({"limit", "run_ids"})


def _cancel_counted(
    answer: tuple[RunStatus, RunStatus] | None,
) -> tuple[int | None, bool] | None:
    if answer is None:
        return None  # no such run: nothing happened
    changed = answer[0] != answer[1]
    return int(changed), changed
