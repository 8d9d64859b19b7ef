"""Keeping the leases of running attempts alive, and noticing attempts past their timeout.

A :class:`LeaseTracker` holds the attempts a process is executing, each under its fence
(run, attempt number, lease token): claims commit asynchronously, so a server crash can lose
a claim the worker still holds, and the same worker can claim the run again (same attempt
number, new token); the two claims must never share an entry. Its owner (the worker's
lifecycle writer) calls ``extend`` a few times per lease period, which pushes every tracked
lease forward in one fenced statement. When an extension is refused (the lease was lost or had
expired) or the run asks to be cancelled, the attempt's ``context.cancelled`` is set.
``expire_timeouts`` hands back attempts whose task timeout has passed; the owner fails them
(``timeout_failure``) so the run moves on at once.

Every entry remembers when its lease was last confirmed (the monotonic time the claim or the
last applied extension was *sent*). A claimed run whose lease may have lapsed since (the
process was paused: SIGSTOP, a VM freeze, a stalled writer) is not started: maintenance may
already have expired the attempt and another worker may hold the run or the queue's slot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import attrs

from runlane._attempt import AttemptControl
from runlane.errors import StopReason
from runlane.models import RunStatus
from runlane.storage import ClaimedRun, LeaseRef, Storage, WorkerBeat
from runlane.tasks import Task

__all__ = ["LeaseTracker", "Tracked"]

log = logging.getLogger("runlane.leases")

# Extend this many times per lease period, so one slow round trip never lets a lease lapse.
_EXTENSIONS_PER_LEASE = 3


@attrs.define(eq=False)
class Tracked:
    claimed: ClaimedRun
    control: AttemptControl | None  # None while claimed but not started (prefetched)
    task: Task[object, object] | None
    deadline: float | None  # time.monotonic() past which the attempt has timed out
    held_at: float = 0.0  # time.monotonic() of the claim
    stop_reason: StopReason | None = None
    # time.monotonic() when the claim or the last applied extension was sent: the lease
    # runs at least until this plus the lease duration (database time ran no slower)
    confirmed_at: float = 0.0
    # time.monotonic() when the handler began (None: claimed, not started), and whether
    # storage was told (run_mark_started)
    begun_at: float | None = None
    marked: bool = False

    def cancel(self, reason: StopReason) -> None:
        """Ask the attempt to stop (the first reason sticks); a run not started yet learns
        it when it starts."""
        if self.stop_reason is None:
            self.stop_reason = reason
        if self.control is not None:
            self.control.request_stop(reason)

    @property
    def ref(self) -> LeaseRef:
        return self.claimed.ref


class LeaseTracker:
    """The attempts one process is executing. Thread-safe."""

    def __init__(self, lease: timedelta) -> None:
        self.lease = lease
        self.interval = lease.total_seconds() / _EXTENSIONS_PER_LEASE
        self._lock = threading.Lock()
        self._tracked: dict[LeaseRef, Tracked] = {}
        self._last_extension = time.monotonic()
        self.on_change: Callable[[], None] | None = None  # the owner re-reads deadlines

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def track(
        self, claimed: ClaimedRun, control: AttemptControl, task: Task[object, object] | None
    ) -> None:
        """Track an attempt that starts executing now."""
        self.hold(claimed)
        self.begin(claimed, control, task)

    def hold(self, claimed: ClaimedRun, *, sent_at: float | None = None) -> None:
        """Keep the lease of a run claimed ahead of a free slot (its timeout starts later).
        ``sent_at`` is the monotonic time the claim was sent (default: now)."""
        self.hold_all([claimed], sent_at=sent_at)

    def hold_all(self, claimed: Sequence[ClaimedRun], *, sent_at: float | None = None) -> None:
        """``hold`` for every run of one claim, telling the owner once."""
        if not claimed:
            return
        now = time.monotonic()
        confirmed_at = sent_at or now
        with self._lock:
            if not self._tracked:
                # a lease granted now: the next extension is due a period from now
                self._last_extension = now
            for run in claimed:
                self._tracked[run.ref] = Tracked(
                    run, None, None, None, now, confirmed_at=confirmed_at
                )
        self._changed()

    def lapsed(self, claimed: ClaimedRun, now: float | None = None) -> bool:
        """Whether the held claim's lease may have lapsed: no claim or extension of it was
        confirmed for longer than the lease less one extension interval (the process was
        paused, or its extensions failed). Such a run must not start."""
        with self._lock:
            item = self._tracked.get(claimed.ref)
            if item is None:
                return False
            since = item.confirmed_at
        budget = self.lease.total_seconds() - self.interval
        return (now if now is not None else time.monotonic()) - since >= budget

    def begin(
        self, claimed: ClaimedRun, control: AttemptControl, task: Task[object, object] | None
    ) -> bool:
        """The held run starts executing; False when its lease was lost meanwhile."""
        timeout = task.timeout if task is not None else None
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        with self._lock:
            item = self._tracked.get(claimed.ref)
            if item is None:
                return False
            item.control, item.task, item.deadline = control, task, deadline
            item.begun_at = time.monotonic()
            if item.stop_reason is not None:
                control.request_stop(item.stop_reason)
        if deadline is not None:
            self._changed()
        return True

    def untrack(self, claimed: ClaimedRun | LeaseRef) -> Tracked | None:
        """Stop tracking; returns the entry, or None when it was already taken (timed out)."""
        key = claimed if isinstance(claimed, LeaseRef) else claimed.ref
        with self._lock:
            return self._tracked.pop(key, None)

    def held_since(self, before: float) -> list[Tracked]:
        """Runs claimed ahead and still not started at ``before`` (monotonic)."""
        with self._lock:
            return [t for t in self._tracked.values() if t.control is None and t.held_at < before]

    def started_unmarked(self, begun_before: float) -> list[Tracked]:
        """Attempts whose handler began before ``begun_before`` (monotonic) and whose start
        storage was not told yet; they are marked as told (``unmark`` after a failed write)."""
        with self._lock:
            due = [
                t
                for t in self._tracked.values()
                if not t.marked and t.begun_at is not None and t.begun_at < begun_before
            ]
            for item in due:
                item.marked = True
        return due

    def next_mark_at(self, after: float) -> float | None:
        """When (monotonic) the next handler start is due to be told: its begin + ``after``."""
        with self._lock:
            begun = [
                t.begun_at
                for t in self._tracked.values()
                if not t.marked and t.begun_at is not None
            ]
        return None if not begun else min(begun) + after

    def unmark(self, items: Sequence[Tracked]) -> None:
        with self._lock:
            for item in items:
                item.marked = False

    def tracked(self) -> list[Tracked]:
        with self._lock:
            return list(self._tracked.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._tracked)

    def next_extension_at(self) -> float | None:
        """The monotonic time the next extension is due, None when nothing is tracked."""
        with self._lock:
            return self._last_extension + self.interval if self._tracked else None

    def next_deadline(self) -> float | None:
        """The monotonic time of the next extension or timeout, None when nothing is tracked."""
        with self._lock:
            if not self._tracked:
                return None
            deadlines = [t.deadline for t in self._tracked.values() if t.deadline is not None]
        return min([self._last_extension + self.interval, *deadlines])

    def expire_timeouts(self, now: float) -> list[Tracked]:
        """Remove and return the attempts whose task timeout has passed."""
        with self._lock:
            late = [
                t for t in self._tracked.values() if t.deadline is not None and now >= t.deadline
            ]
            for item in late:
                del self._tracked[item.ref]
        for item in late:
            # the failure itself is logged once, by the writer (runlane.worker._failure_log)
            log.debug(
                "run %s attempt %d of %s passed its timeout; failing the attempt",
                item.claimed.id,
                item.claimed.attempt,
                item.claimed.task_id,
            )
            item.cancel(StopReason.TIMEOUT)
        return late

    def extension_due(self, now: float) -> bool:
        return now - self._last_extension >= self.interval

    def extend_soon(self) -> None:
        """Make the next extension due now (it reads every tracked run's status, so a
        cancellation whose announcement was missed reaches its handler at once rather than
        up to one interval later); nothing when nothing is tracked."""
        with self._lock:
            if not self._tracked:
                return
            self._last_extension = min(self._last_extension, time.monotonic() - self.interval)
        self._changed()

    def extend(self, storage: Storage, *, beat: WorkerBeat | None = None) -> bool:
        """Extend every tracked lease in one fenced statement (carrying the worker's
        heartbeat ``beat``); signal the ones refused. False when nothing was tracked and
        no statement was sent."""
        sent = self._last_extension = time.monotonic()
        live = self.tracked()
        if not live:
            return False
        applied = storage.run_extend_leases([item.ref for item in live], self.lease, beat=beat)
        for item in live:
            status = applied.get(item.ref)
            if status is not None:
                item.confirmed_at = max(item.confirmed_at, sent)
            if status is None:
                if self.untrack(item.ref) is None:
                    continue  # finished meanwhile: its lease was released, not lost
                log.warning(
                    "run %s attempt %d lost its lease; signalling its handler to stop",
                    item.claimed.id,
                    item.claimed.attempt,
                )
                item.cancel(StopReason.LEASE_LOST)
            elif status is RunStatus.CANCELLATION_REQUESTED:
                item.cancel(StopReason.CANCEL_REQUESTED)
        return True
