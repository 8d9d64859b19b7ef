"""The lifecycle-write thread: one writer for the completions, failures, hand-backs and lease
extensions of every slot in a worker.

Slots ``submit`` a finished attempt's write and go back to work; the writer swaps the pending
list out under its lock and writes it outside the lock, one statement per kind, each row
still fenced by run, attempt and lease token. It flushes when ``batch_size`` writes are
pending, every ``tick``, and on close. Submitters wait while ``max_backlog`` writes are
pending, so a slow database slows the handlers instead of growing memory without bound.
A connection lost mid-batch is retried with backoff; nothing pending is dropped until close
gives up at its deadline (cancelling a statement still blocked then), and an attempt whose
write was never made is recovered by maintenance when its lease expires. A write submitted
after the final flush (a handler or a claim that outlived close) is made at once on
``late_storage``.

A delivery worker's heartbeat (``beat``, its registration in ``workers``) rides in the lease
extension statement; when no extension went out for a heartbeat interval (no leases held, or
leases claimed too recently to extend), the heartbeat goes alone, so it costs one statement
an interval whatever the number of runs. Its state (``stopping`` once close begins) goes out
with the next heartbeat, and ``stopped`` after the final flush.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable

import attrs

from runlane._attempt import THROTTLE_SECONDS, AttemptProgress
from runlane.errors import RunlaneClosed, RunlaneError, StorageUnavailable
from runlane.models import WorkerState
from runlane.storage import (
    Completion,
    Failure,
    LeaseRef,
    OutputRefused,
    ProgressWrite,
    Storage,
    WorkerBeat,
)
from runlane.toolkit import Backoff, Deadline
from runlane.worker._execution import refused_output_failure, timeout_failure
from runlane.worker._failure_log import log_failure
from runlane.worker._idle import IdleConnection
from runlane.worker._leases import LeaseTracker, Tracked

__all__ = ["LifecycleStats", "LifecycleWriter"]

log = logging.getLogger("runlane.lifecycle")

# output characters written in one completion statement (several times that as jsonb)
_STATEMENT_OUTPUT_CHARS = 16 * 1024 * 1024

# the end of close's timeout kept for a statement still blocked then: it is interrupted
# and gets the rest to return (at most half the timeout)
_CLOSE_GRACE_SECONDS = 0.25

# a handler still running this long after it began is told to storage (run_mark_started):
# its run shows as executing rather than only claimed. Handlers that end sooner cost no write.
MARK_STARTED_AFTER_SECONDS = 0.1
_MARK_RETRY_SECONDS = 1.0  # after a failed mark (storage unavailable)


@attrs.define
class LifecycleStats:
    """Counters of one writer, for tests and metrics."""

    completed: int = 0
    failed: int = 0
    released: int = 0
    stale: int = 0
    batches: int = 0
    progress: int = 0  # progress writes applied
    beats_alone: int = 0  # heartbeats sent in a statement of their own
    beats_with_extensions: int = 0  # heartbeats carried by a lease extension
    marked_started: int = 0  # handler starts told to storage (run_mark_started)


@attrs.define
class _Pending:
    completions: list[Completion] = attrs.Factory(list)
    failures: list[Failure] = attrs.Factory(list)
    releases: list[LeaseRef] = attrs.Factory(list)
    # handlers' progress due now (throttled per attempt): written before the rest
    progress: list[tuple[AttemptProgress, str]] = attrs.Factory(list)
    applied_any: bool = False

    def __len__(self) -> int:
        return len(self.completions) + len(self.failures) + len(self.releases) + len(self.progress)


class LifecycleWriter:
    def __init__(
        self,
        storage: Storage | IdleConnection,
        tracker: LeaseTracker,
        *,
        environment: str,
        name: str,
        on_timeout: Callable[[Tracked], None],
        on_fatal: Callable[[BaseException], None],
        on_written: Callable[[], None] | None = None,
        on_tick: Callable[[], None] | None = None,
        late_storage: Storage | None = None,
        beat: WorkerBeat | None = None,
        tick: float = 0.02,
        batch_size: int = 500,
        max_backlog: int = 10_000,
    ) -> None:
        # an IdleConnection: its own connection while leases are held or writes pending,
        # the runtime's pool while idle (heartbeats alone)
        self._connection = storage
        self._tracker = tracker
        self._environment = environment
        self._name = name
        self._on_timeout = on_timeout
        self._on_fatal = on_fatal
        self._on_written = on_written
        self._on_tick = on_tick
        self._late_storage = late_storage or self._storage
        self._beat = beat
        # time.monotonic() of the last heartbeat sent: the first (the worker's registration)
        # is the thread's first work
        self._last_beat = -math.inf
        self.registered = threading.Event()  # set once a heartbeat was written
        tracker.on_change = self._poke
        self._tick = tick
        self._batch_size = batch_size
        self._max_backlog = max_backlog
        self._cond = threading.Condition()
        self._pending = _Pending()
        # attempts with progress not yet written (runlane/_attempt.py)
        self._progress: dict[LeaseRef, AttemptProgress] = {}
        self._in_flight = 0
        self._marks_retry_at = 0.0  # time.monotonic() before which no mark is retried
        self._closing = False
        self._finished = False  # the thread has made its final flush
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None
        self.stats = LifecycleStats()

    @property
    def _storage(self) -> Storage:
        """Where the writer's next statement goes: its own connection while it has leases or
        writes in hand (or had within the grace), else the runtime's pool."""
        conn = self._connection
        if not isinstance(conn, IdleConnection):
            return conn
        return conn.get(bool(len(self._tracker) or self._pending or self._in_flight))

    # -- producers -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()

    def submit(self, write: Completion | Failure) -> None:
        with self._cond:
            while len(self._pending) + self._in_flight >= self._max_backlog and not self._closing:
                self._cond.wait(timeout=1.0)
            finished = self._finished
            if not finished:
                if isinstance(write, Completion):
                    self._pending.completions.append(write)
                else:
                    self._pending.failures.append(write)
                if len(self._pending) in (1, self._batch_size):
                    self._cond.notify_all()
        if finished:
            late = _Pending()
            if isinstance(write, Completion):
                late.completions.append(write)
            else:
                late.failures.append(write)
            self._write_late(late)

    def release(self, ref: LeaseRef) -> None:
        """Hand an attempt back unconsumed (not started, or stopped by shutdown)."""
        with self._cond:
            finished = self._finished
            if not finished:
                self._pending.releases.append(ref)
                self._cond.notify_all()
        if finished:
            self._write_late(_Pending(releases=[ref]))

    def progress(self, attempt: AttemptProgress, value: str) -> None:
        """A handler's progress: the last value wins; written within a second, or with its
        attempt's completion, failure or hand-back (see runlane/_attempt.py)."""
        with self._cond:
            finished = self._finished
            if not finished:
                attempt.pending = value
                self._progress[attempt.lease] = attempt
                if time.monotonic() - attempt.last_written >= THROTTLE_SECONDS:
                    self._cond.notify_all()
        if finished:
            self._write_late(_Pending(progress=[(attempt, value)]))

    def _due_progress(self, batch: _Pending, closing: bool) -> list[tuple[AttemptProgress, str]]:
        """Take the progress to write with ``batch`` (under the lock): each attempt's once a
        second, and at once when the batch ends its attempt or the writer closes."""
        if not self._progress:
            return []
        now = time.monotonic()
        ending = {c.run_id for c in batch.completions}
        ending.update(f.run_id for f in batch.failures)
        ending.update(r.run_id for r in batch.releases)
        due = []
        for lease, attempt in list(self._progress.items()):
            if closing or lease.run_id in ending or now - attempt.last_written >= THROTTLE_SECONDS:
                del self._progress[lease]
                if attempt.pending is not None:
                    due.append((attempt, attempt.pending))
                    attempt.pending = None
                    attempt.last_written = now
        return due

    def _write_late(self, late: _Pending) -> None:
        """The thread made its final flush already: write this one here, now."""
        try:
            self._write(late, self._late_storage)
        except RunlaneError as exc:
            log.error(  # noqa: TRY400 - an expected outage, not a bug: no traceback
                "runlane: a write after close failed (%s); its attempt is recovered by "
                "maintenance when its lease expires",
                exc,
            )

    def _poke(self) -> None:
        """Lease work changed (an attempt was claimed or started): re-read the deadlines."""
        with self._cond:
            self._cond.notify_all()

    def set_worker_state(self, state: WorkerState) -> None:
        """The worker's state changed (``stopping``): send it with a heartbeat at once."""
        with self._cond:
            if self._beat is None or self._beat.state is state:
                return
            self._beat = attrs.evolve(self._beat, state=state)
            self._last_beat = -math.inf
            self._cond.notify_all()

    def backlog(self) -> int:
        with self._cond:
            return len(self._pending) + self._in_flight

    def close(self, timeout: float | None) -> None:
        """Write everything pending, then stop; within ``timeout`` seconds from now (None: as
        long as it takes). The writes get all but a short grace at the end; a statement
        still blocked then is interrupted (cancelled, or its socket shut down when the
        server does not answer) and the thread gets the rest of the grace to return."""
        end = Deadline(timeout)
        flush = None if timeout is None else timeout - min(_CLOSE_GRACE_SECONDS, timeout / 2)
        with self._cond:
            self._closing = True
            self._deadline = None if flush is None else time.monotonic() + flush
            self._cond.notify_all()
        if self._thread is None:
            return
        self._thread.join(flush)
        if self._thread.is_alive():
            self._connection.interrupt()
            self._thread.join(end.left())
        if self._thread.is_alive():
            log.warning(
                "runlane: %s did not finish within the close timeout; giving up on it", self._name
            )

    # -- the thread ------------------------------------------------------------------------

    def _lease_wait(self) -> float:
        """Seconds until lease work (an extension, a timeout, a heartbeat) is due; at most
        one."""
        deadline = self._tracker.next_deadline()
        mark_at = self._tracker.next_mark_at(MARK_STARTED_AFTER_SECONDS)
        if mark_at is not None:
            mark_at = max(mark_at, self._marks_retry_at)
            deadline = mark_at if deadline is None else min(deadline, mark_at)
        beat_at = self._beat_alone_at()
        if beat_at is not None:
            deadline = beat_at if deadline is None else min(deadline, beat_at)
        if deadline is None:
            return 1.0
        return min(1.0, max(0.0, deadline - time.monotonic()))

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            if isinstance(exc, RunlaneClosed) and self._closing:
                # close gave up on this thread (it said so) and closed its connection under it
                log.debug("runlane: %s ends after its close: %s", self._name, exc)
                return
            log.exception("runlane: the lifecycle writer failed")
            self._on_fatal(exc)

    def _run(self) -> None:
        while True:
            with self._cond:
                # idle: sleep until a write arrives, lease work is due, or a second passes
                # (the tick also hands back runs that waited too long for a slot)
                if not self._closing and not self._pending:
                    wait = self._lease_wait()
                    if wait > 0:
                        self._cond.wait(timeout=wait)
                # a write arrived: give others one tick to join its batch
                if not self._closing and 0 < len(self._pending) < self._batch_size:
                    self._cond.wait(timeout=min(self._tick, self._lease_wait()))
                batch, self._pending = self._pending, _Pending()
                closing = self._closing
                batch.progress = self._due_progress(batch, closing)
                self._in_flight = len(batch)
            self._write_until_done(batch)
            with self._cond:
                self._in_flight = 0
                self._cond.notify_all()
                finished = closing and not self._pending
                if finished:
                    self._finished = True
            if finished:
                self._beat_stopped()
                return
            if batch.applied_any and self._on_written is not None:
                self._on_written()
            self._keep_leases()

    def _keep_leases(self) -> None:
        if self._on_tick is not None:
            self._on_tick()
        if isinstance(self._connection, IdleConnection) and not len(self._tracker):
            self._connection.release_if_idle()
        now = time.monotonic()
        for item in self._tracker.expire_timeouts(now):
            timed_out = timeout_failure(item.claimed, item.task)
            with self._cond:
                self._pending.failures.append(timed_out.write)  # type: ignore[arg-type]
            # the attempt's one failure record (WARNING when retried, ERROR when final)
            ran = now - item.begun_at if item.begun_at is not None else 0.0
            log_failure(item.claimed, timed_out, ran)
            self._on_timeout(item)
        self._mark_started(now)
        beat = self._beat
        if self._tracker.extension_due(now):
            try:
                sent = self._tracker.extend(self._storage, beat=beat)
                if sent and beat is not None and self._beat is beat:  # not changed meanwhile
                    self._last_beat = now
                    self.stats.beats_with_extensions += 1
                    self.registered.set()
            except StorageUnavailable as exc:
                log.warning("runlane: extending leases failed (%s); retrying next tick", exc)
                return
        beat_at = self._beat_alone_at()
        if beat is not None and beat_at is not None and now >= beat_at:
            try:
                self._send_beat()
            except StorageUnavailable as exc:
                # like a claim or an extension: logged, retried, never fatal
                log.warning(
                    "runlane: %s: %s failed (%s); retrying in %.1fs",
                    self._name,
                    "the heartbeat" if self.registered.is_set() else "registering the worker",
                    exc,
                    beat.heartbeat_seconds,
                )

    def _mark_started(self, now: float) -> None:
        """Tell storage which handlers have been running for a while (one statement for all
        of them): their runs are executing, not only claimed. A failure is retried next tick;
        a lost lease simply marks nothing."""
        if now < self._marks_retry_at:
            return
        started = self._tracker.started_unmarked(now - MARK_STARTED_AFTER_SECONDS)
        if not started:
            return
        try:
            self._storage.run_mark_started([item.ref for item in started])
        except StorageUnavailable as exc:
            self._tracker.unmark(started)
            self._marks_retry_at = now + _MARK_RETRY_SECONDS
            log.warning("runlane: marking started handlers failed (%s); retrying", exc)
        except RunlaneError as exc:
            # a role granted before the column existed may not write it: the runs still
            # execute, status() only counts them as claimed; never fatal to the worker
            self._marks_retry_at = math.inf
            log.warning(
                "runlane: %s cannot record that handlers started (%s); status() counts its "
                "running runs as claimed, not started. Grant the worker job again "
                "(`runlane grant worker ROLE`) and restart the worker",
                self._name,
                exc,
            )
        else:
            self.stats.marked_started += len(started)

    def _beat_alone_at(self) -> float | None:
        """When the heartbeat is due in a statement of its own (monotonic), None when there
        is none or a lease extension due within half an interval of it will carry it (late
        by at most that: the worker shows lost only after three intervals)."""
        beat = self._beat
        if beat is None:
            return None
        due = self._last_beat + beat.heartbeat_seconds
        extension_at = self._tracker.next_extension_at()
        if extension_at is not None and extension_at - due <= beat.heartbeat_seconds / 2:
            return None
        return due

    def _send_beat(self) -> None:
        """The heartbeat alone (no lease to extend): one statement. A failure counts as
        sent, so the next try waits an interval."""
        assert self._beat is not None
        self._last_beat = time.monotonic()
        self._storage.run_extend_leases([], self._tracker.lease, beat=self._beat)
        self.stats.beats_alone += 1
        self.registered.set()

    def _beat_stopped(self) -> None:
        """After the final flush: the worker's row says ``stopped`` (not if close's deadline
        passed; the row shows the worker lost once its heartbeats are missed)."""
        if self._beat is None or self._past_deadline():
            return
        with self._cond:
            self._beat = attrs.evolve(self._beat, state=WorkerState.STOPPED)
        try:
            self._send_beat()
        except RunlaneError as exc:
            log.warning(
                "runlane: %s could not mark itself stopped (%s); it is shown as lost once "
                "three heartbeats are missed",
                self._name,
                exc,
            )

    def _past_deadline(self) -> bool:
        with self._cond:
            return self._deadline is not None and time.monotonic() >= self._deadline

    def _write_until_done(self, batch: _Pending) -> None:
        backoff = Backoff()
        while len(batch):
            try:
                self._write(batch, self._storage)
            except StorageUnavailable as exc:
                if self._past_deadline():
                    _unwritten(batch, exc)
                    return
                log.warning("runlane: lifecycle write failed (%s); retrying", exc)
                with self._cond:
                    wait = backoff.next()
                    if self._deadline is not None:
                        wait = min(wait, max(0.0, self._deadline - time.monotonic()))
                    self._cond.wait(timeout=wait)
            except RunlaneClosed as exc:
                if not self._closing:
                    raise
                # close gave up on this thread and closed its connection under it
                _unwritten(batch, exc)
                return
            else:
                return

    def _write(self, batch: _Pending, storage: Storage) -> None:
        """Write each kind in one statement; a kind written is removed, so a retry after a
        lost connection repeats only what may not have been applied (and fencing makes a
        repeat of an applied write a harmless no-op)."""
        if batch.progress:  # first: the writes below end the attempts' leases
            written = storage.run_progress_many(
                [ProgressWrite(attempt.lease, value) for attempt, value in batch.progress]
            )
            for attempt, _ in batch.progress:
                if attempt.lease.run_id not in written:
                    attempt.stale = True  # the handler's next report raises StaleLease
            self.stats.progress += len(written)
            batch.progress = []
        self._write_completions(batch, storage)
        if batch.failures:
            failed = {row.run_id for row in storage.run_fail_many(batch.failures)}
            self._count_stale("failure", [f.run_id for f in batch.failures], failed)
            self.stats.failed += len(failed)
            batch.applied_any = batch.applied_any or bool(failed)
            batch.failures = []
        if batch.releases:
            released = storage.run_release_many(self._environment, batch.releases)
            self._count_stale("hand-back", [r.run_id for r in batch.releases], released)
            self.stats.released += len(released)
            batch.releases = []
        self.stats.batches += 1

    def _write_completions(self, batch: _Pending, storage: Storage) -> None:
        """Completions in statements of at most _STATEMENT_OUTPUT_CHARS of output, each
        removed from the batch once written. When the database refuses an output (JSON text
        within max_output_bytes can be too large as jsonb), the rest go one by one, and a
        refused one becomes a failure of its attempt, not retried: the handler would
        return the same value."""
        one_by_one = False
        while batch.completions:
            chunk = batch.completions[:1] if one_by_one else _within(batch.completions)
            try:
                applied = storage.run_complete_many(chunk)
            except OutputRefused as exc:
                if len(chunk) > 1:
                    one_by_one = True
                    continue
                refused = chunk[0]
                log.warning(
                    "runlane: run %s attempt %d: the database refused its return value (%s); "
                    "failing the attempt",
                    refused.run_id,
                    refused.attempt,
                    exc,
                )
                batch.failures.append(refused_output_failure(refused, str(exc)))
            else:
                self._count_stale("completion", [c.run_id for c in chunk], applied)
                self.stats.completed += len(applied)
                batch.applied_any = batch.applied_any or bool(applied)
            del batch.completions[: len(chunk)]

    def _count_stale(self, kind: str, wanted: list[uuid.UUID], applied: set[uuid.UUID]) -> None:
        stale = [run_id for run_id in wanted if run_id not in applied]
        if stale:
            self.stats.stale += len(stale)
            log.warning(
                "runlane: %d %s write(s) rejected as stale (lease lost): %s",
                len(stale),
                kind,
                ", ".join(str(run_id) for run_id in stale[:10]),
            )


def _within(completions: list[Completion]) -> list[Completion]:
    """The longest prefix of ``completions`` (at least one) whose outputs fit in one
    statement: a batch of large outputs as one parameter could pass Postgres's 1 GiB."""
    size = 0
    for n, completion in enumerate(completions):
        size += len(completion.output)
        if size > _STATEMENT_OUTPUT_CHARS and n:
            return completions[:n]
    return completions


def _unwritten(batch: _Pending, exc: RunlaneError) -> None:
    log.error(  # an expected outage, not a bug: no traceback
        "runlane: closing with %d lifecycle writes unwritten (%s); their attempts are "
        "recovered by maintenance when their leases expire",
        len(batch),
        exc,
    )
