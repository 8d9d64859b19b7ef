"""``run_until_idle``: drain and maintenance passes until nothing is due (re-exported by
``runlane.testing``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import attrs

from runlane._validation import as_duration
from runlane.maintenance import MaintenanceResult
from runlane.models import RunStatus
from runlane.runtime import Runlane
from runlane.toolkit import MAX_WAIT_SECONDS, as_int, as_seconds

__all__ = ["IdleResult", "run_until_idle"]

# Statuses whose ``due_at`` says when a pass will make them runnable again.
_DEFERRED = (RunStatus.RETRYING, RunStatus.RELEASED, RunStatus.WAITING)
_SKEW_MARGIN = 0.05  # seconds slept past a due time: database and process clocks differ
_TIMER_JOIN_SECONDS = 1.0  # a cancelled timer's thread ends at once; never wait longer


@attrs.frozen
class IdleResult:
    """What one :func:`run_until_idle` call did, summed over its passes."""

    passes: int  # drain + maintenance rounds, the last of which found nothing to do
    runs_executed: int  # attempts executed by the drains
    completed: int  # attempts that completed their run
    failed: int  # attempts that failed their run for good
    retried: int  # failed attempts whose run was scheduled to retry
    maintenance: MaintenanceResult  # the records the maintenance passes changed


def run_until_idle(
    runlane: Runlane,
    *,
    max_passes: int = 50,
    timeout: float = 30.0,
    due_within: float = 0.0,
    queues: Sequence[str] | None = None,
) -> IdleResult:
    """Run everything that is due now, in the calling thread, until nothing is.

    Each pass drains, then runs one maintenance pass; it returns after the first pass that
    changed nothing. Work due later is left for later, unless due within ``due_within``
    seconds (then it sleeps until then and passes again). Raises ``RuntimeError`` when work
    still changes after ``max_passes``, ``TimeoutError`` after ``timeout`` seconds (a
    running handler is asked to stop first), and ``ConfigurationError`` on a lane without
    ``drain()``. See docs/testing.md.
    """
    as_int("max_passes", max_passes, 1)
    # a timeout threading.Timer accepts (inf and NaN are refused, not a crash in the timer)
    timeout = as_seconds("timeout", timeout, MAX_WAIT_SECONDS)
    due_within = as_duration("due_within", due_within).total_seconds()
    deadline = time.monotonic() + timeout
    stop = threading.Event()
    timer = threading.Timer(timeout, stop.set)
    timer.name = "runlane-run-until-idle-timer"
    timer.daemon = True
    timer.start()
    totals = {"runs_executed": 0, "completed": 0, "failed": 0, "retried": 0}
    maintenance = MaintenanceResult()
    try:
        for passes in range(1, max_passes + 1):
            drained = runlane.drain(queues=queues, stop=stop)
            if stop.is_set():
                break
            totals["runs_executed"] += drained.runs_executed
            totals["completed"] += drained.completed
            totals["failed"] += drained.failed
            totals["retried"] += drained.retried
            changed = runlane.run_maintenance_once()
            maintenance += changed
            if drained.runs_executed or changed.total:
                continue
            wake = _next_due(runlane, due_within) if due_within else None
            if wake is None:
                return IdleResult(passes=passes, maintenance=maintenance, **totals)
            pause = min(wake, deadline - time.monotonic())
            if pause <= 0 or stop.wait(pause):
                break
        else:
            raise RuntimeError(
                f"run_until_idle: work was still being done after {max_passes} passes "
                f"({totals['runs_executed']} attempts executed): does a task trigger or "
                "release itself forever? Raise max_passes if the work is legitimately longer"
            )
    finally:
        timer.cancel()
        timer.join(_TIMER_JOIN_SECONDS)  # cancelled, it ends at once: nothing left behind
    raise TimeoutError(
        f"run_until_idle: work was still due after {timeout:g} s "
        f"({totals['runs_executed']} attempts executed); raise timeout= if handlers are slow"
    )


def _next_due(runlane: Runlane, within: float) -> float | None:
    """Seconds until the earliest retrying, released or waiting run due later than now but
    within ``within`` seconds (plus a margin for clock skew), or None when there is none."""
    now = datetime.now(UTC)
    horizon = now + timedelta(seconds=within)
    earliest: datetime | None = None
    for status in _DEFERRED:
        cursor: str | None = None
        while True:
            page = runlane.list_runs(status=status, limit=1000, cursor=cursor)
            for run in page.runs:
                due = run.due_at
                if now < due <= horizon and (earliest is None or due < earliest):
                    earliest = run.due_at
            cursor = page.next_cursor
            if cursor is None:
                break
    if earliest is None:
        return None
    return (earliest - now).total_seconds() + _SKEW_MARGIN
