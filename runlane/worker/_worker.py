"""The delivery worker: a lane-agnostic slot pool, the lane's acquirer and a lifecycle writer.

The parts, one job each: ``_slots.py`` (the handler threads and their pool), ``_handoff.py``
(how slots get runs: the hand-off and the claims), ``_execution.py`` (one attempt's handler
and the write that records it), ``_leases.py`` (the leases and timeouts of the attempts held),
``_lifecycle.py`` (the writer), ``_attempts.py`` (an attempt from its start to the write that
records it), ``_drain.py`` (drain's stop event). This module starts them, and closes them.

Threads of one worker (``W`` is its number in this process):

- ``runlane-worker-W-slot-I`` (``concurrency`` of them) run handlers; each has its own
  connection for its handler's steps, waits, sleeps and releases. An idle slot waits for a
  hand-off; when no slot is acquiring, it becomes the acquirer and asks the lane's acquirer
  for as many runs as there are idle slots, keeps one and hands the rest to the others.
  When nothing is due it waits on the acquirer (a wake-up or the poll interval).
- ``runlane-worker-W-writer`` writes completions, failures, hand-backs and lease extensions in
  batches and fails attempts that pass their task's timeout (see ``_lifecycle.py``).
- The lane's own threads (the polling lane: ``runlane-worker-W-listener``).

``drain()`` runs the same pool with one slot in the caller's thread, so it claims, honours
bounded queues and records results exactly as a worker does.

A slot whose handler passed its timeout is abandoned and a fresh slot takes its place (see
``_slots.py``).

Closing is bounded and loses nothing: acquisition stops, running handlers are asked to stop
(``StopReason.SHUTDOWN``), slots are joined until the deadline, a claim still in flight is
aborted, and every run claimed but not finished (including one a late claim returns) is
handed back with its attempt unspent.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import attrs

from runlane import _telemetry
from runlane._limits import MAX_CONCURRENCY
from runlane._operator.workers import new_beat
from runlane.context import ContextBackend
from runlane.errors import ConfigurationError, StopReason, WorkerFailed
from runlane.lanes import Acquirer, AcquirerOptions, Lane
from runlane.models import WorkerState
from runlane.storage import ClaimedRun, Storage
from runlane.tasks import Queue, Task
from runlane.toolkit import Closing, Deadline, as_int, as_wait_timeout, shown, wait_event
from runlane.worker._attempts import Attempts
from runlane.worker._drain import StopWatcher
from runlane.worker._handoff import HandOff
from runlane.worker._idle import IdleConnection
from runlane.worker._leases import LeaseTracker, Tracked
from runlane.worker._lifecycle import LifecycleStats, LifecycleWriter
from runlane.worker._middleware import Middleware
from runlane.worker._slots import Slot, SlotPool
from runlane.worker._watch import MaintenanceWatch

__all__ = ["Worker", "WorkerOptions", "check_worker_arguments"]

log = logging.getLogger("runlane.worker")

_numbers = itertools.count(1)
# after close's deadline, one grace shared by everything still to do (an aborted claim
# returning its runs, the writer's last writes, the lane's threads): not a grace each
_CLOSE_GRACE_SECONDS = 0.75
# of that grace: how long an aborted claim in flight gets to return its runs
_ABORT_GRACE_SECONDS = 0.25
# the close an infrastructure failure starts in its own thread gives handlers this long
_FAILURE_CLOSE_SECONDS = 30.0
_CONCURRENCY_HINT = (
    " (a thread and a database connection each); for more, run more worker processes"
)


@attrs.frozen
class WorkerOptions:
    concurrency: int
    lease: timedelta
    claim_batch: int
    prefetch: int = 0  # runs claimed ahead of free slots while a backlog lasts
    acquirers: int = 1
    drain: bool = False  # one slot in the caller's thread; stop when nothing is due


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class Worker:
    """Executes runs of the given queues in ``concurrency`` threads until closed.

    Make one with :meth:`Runlane.create_delivery_worker`. ``close(timeout)`` stops
    acquisition, asks running handlers to stop (``context.cancelled`` is set,
    ``context.stop_reason`` is ``StopReason.SHUTDOWN``), waits for them until ``timeout``,
    hands every unfinished or not yet started run back with its attempt unspent, flushes
    pending writes and closes connections; it returns within ``timeout`` plus about a second
    (the grace an aborted claim or a cancelled write gets) whatever blocks.
    """

    def __init__(
        self,
        *,
        storage: Storage,
        environment: str,
        tasks: dict[str, Task[Any, Any]],
        queues: Sequence[Queue],
        options: WorkerOptions,
        lane: Lane,
        make_backend: Callable[[Storage], ContextBackend],
        on_closed: Callable[[Worker], None] | None = None,
        middleware: Sequence[Middleware] = (),
    ) -> None:
        self.name = f"runlane-{'drain' if options.drain else 'worker'}-{next(_numbers)}"
        self.storage = storage
        self.environment = environment
        self._options = options
        self._on_closed = on_closed
        # one condition guards the slot pool and the hand-off (a slot moves between them)
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self._close_started = False
        self._closer: threading.Thread | None = None  # closes the worker after a failure
        self._failure: BaseException | None = None
        self._pool = SlotPool(
            name=self.name,
            storage=storage,
            make_backend=make_backend,
            inline=options.drain,
            concurrency=options.concurrency,
            cond=self._cond,
            stopping=self._stopping,
            run_slot=self._slot_main,
        )
        # test hook: set when a claim found nothing due
        self.idle_signal = threading.Event()
        self._tracker = LeaseTracker(options.lease)
        # a delivery worker's row in workers (drain registers nothing); its heartbeat rides
        # with the writer's lease extensions, one interval apart
        beat = (
            None
            if options.drain
            else new_beat(
                environment, [q.name for q in queues], options.concurrency, self._tracker.interval
            )
        )
        self.worker_id: uuid.UUID | None = None if beat is None else beat.worker_id
        # the writer's own connection, let go while the worker is idle (_idle.py)
        self._writer_storage = (
            storage if options.drain else IdleConnection(storage, f"{self.name}-writer")
        )
        self._acquirer = lane.create_acquirer(
            storage,
            AcquirerOptions(
                environment=environment,
                queues=list(queues),
                name=self.name,
                lease=options.lease,
                drain=options.drain,
                concurrency=options.concurrency,
                claim_batch=options.claim_batch,
                worker_id=self.worker_id,
            ),
            self._on_cancel,
        )
        self._writer = LifecycleWriter(
            self._writer_storage,
            self._tracker,
            environment=environment,
            name=f"{self.name}-writer",
            on_timeout=self._on_timeout,
            on_fatal=self._fail,
            # freed capacity of a bounded queue: let the acquirer look again at once
            on_written=self._acquirer.interrupt if any(q.bounded for q in queues) else None,
            on_tick=self._on_tick,
            late_storage=storage,
            beat=beat,
        )

        self._watch = None if options.drain else MaintenanceWatch(storage, environment)
        self._handoff = HandOff(
            cond=self._cond,
            stopping=self._stopping,
            acquirer=self._acquirer,
            tracker=self._tracker,
            writer=self._writer,
            pool=self._pool,
            queues=queues,
            concurrency=options.concurrency,
            prefetch=options.prefetch,
            claim_batch=options.claim_batch,
            acquirers=options.acquirers,
            drain=options.drain,
            hand_back=self._hand_back,
            idle_signal=self.idle_signal,
        )
        self._attempts = Attempts(
            environment=environment,
            tasks=tasks,
            middleware=middleware,
            lease=options.lease,
            drain=options.drain,
            cond=self._cond,
            stopping=self._stopping,
            tracker=self._tracker,
            writer=self._writer,
            pool=self._pool,
            handoff=self._handoff,
            hand_back=self._hand_back,
        )

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the writer (whose first work is the worker's registration), the lane's
        delivery path and the slot threads."""
        self._writer.start()
        self._acquirer.start()
        if self._options.drain:
            return
        with self._cond:
            for _ in range(self._options.concurrency):
                self._pool.start_slot_locked()

    def run_inline(
        self,
        max_runs: int | None,
        stop: threading.Event | None,
        on_progress: Callable[[], None] | None = None,
    ) -> int:
        """drain(): execute due runs in the calling thread until none is due, ``max_runs``
        handlers ran, or ``stop`` is set; then close. Returns the handlers run;
        ``on_progress`` is called after each attempt. ``stop`` set while a handler runs asks
        it to stop as close() does (``context.cancelled``, ``StopReason.SHUTDOWN``): a
        handler that stops by raising hands its run back with its attempt unspent."""
        slot = self._pool.new_slot(1)
        watcher = None if stop is None else StopWatcher(self.name, stop, self.stop_acquiring)
        try:
            while max_runs is None or self.runs_executed < max_runs:
                if stop is not None and stop.is_set():
                    break
                claimed = self._handoff.next_run(slot)
                if claimed is None:
                    break
                self._attempts.run(slot, claimed)
                if on_progress is not None:
                    on_progress()
        finally:
            if watcher is not None:
                watcher.close()
            self.close(None)
        if self._failure is not None:
            raise self._failure
        return self.runs_executed

    @property
    def runs_executed(self) -> int:
        """Handlers this worker ran (an attempt handed back before it began is not one)."""
        return self._attempts.runs_executed

    @property
    def outcomes(self) -> dict[str, int]:
        """drain only: its attempts by outcome (see ``_telemetry.outcome_kind``)."""
        return self._attempts.outcomes

    @property
    def stats(self) -> LifecycleStats:
        return self._writer.stats

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def acquirer(self) -> Acquirer:
        """The lane's delivery path of this worker (for tests and diagnostics: e.g. the
        conformance suite's ``acquirer.wait_ready``)."""
        return self._acquirer

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_until_closed(self, timeout: float | None = None) -> bool:
        """Block until the worker is closed (by ``close`` or by a failure); observes only.

        Returns False when ``timeout`` passed first. Raises :class:`WorkerFailed` when a slot
        failed for infrastructure reasons (a handler's exception is a run failure instead);
        a clean close never raises.
        """
        deadline = Deadline(as_wait_timeout("timeout", timeout))
        if not wait_event(self._closed, deadline.left()):  # in slices: see runlane.toolkit
            return False
        self._join_closer(deadline)
        if self._failure is not None:
            raise WorkerFailed(
                f"{self.name} stopped after an infrastructure failure: {self._failure!r}; "
                "restart the process (its unfinished runs were handed back or will be "
                "recovered by maintenance)"
            ) from self._failure
        return True

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker; safe to call again and from any thread.

        Handlers get until ``timeout`` seconds (None: as long as they take) to return after
        they are asked to stop; runs still executing then are handed back with their attempt
        unspent. Returns within ``timeout`` plus under a second whatever blocks.
        """
        limit = as_wait_timeout("timeout", timeout)
        with self._close_lock:
            first = not self._close_started
            self._close_started = True
        if not first:
            # a close already under way (another caller's, or the closer thread a failure
            # started): wait for it, and for that thread to end, within this timeout
            deadline = Deadline(limit)
            if self._closed.wait(deadline.left()):
                self._join_closer(deadline)
            return
        try:
            self._shutdown(limit)
        finally:
            self._closed.set()
            if self._on_closed is not None:
                self._on_closed(self)

    def _join_closer(self, deadline: Deadline) -> None:
        """Wait (within ``deadline``) for the closer thread a failure started to end: it
        sets ``closed`` and then tells the runtime, after which nothing of it is left."""
        closer = self._closer
        if closer is not None and closer is not threading.current_thread():
            closer.join(deadline.left())

    def stop_acquiring(self) -> None:
        """The first step of closing: claim nothing more and ask running handlers to stop.
        ``Runlane.close()`` calls it on every worker first, so a run one worker hands back
        is not claimed by another worker of the same closing runtime."""
        self._stopping.set()
        self._writer.set_worker_state(WorkerState.STOPPING)
        self._acquirer.interrupt()
        with self._cond:
            self._cond.notify_all()
        for item in self._tracker.tracked():
            item.cancel(StopReason.SHUTDOWN)

    def _shutdown(self, timeout: float | None) -> None:
        """Every part runs even when one before it raised (the first error is raised at
        the end): a part that failed must not leave the writer, the lane's threads or the
        connections behind."""
        deadline = None if timeout is None else time.monotonic() + timeout
        grace_end = None if deadline is None else deadline + _CLOSE_GRACE_SECONDS
        closing = Closing(self.name)
        with closing.part("asking to stop"):
            self.stop_acquiring()
        with self._cond:
            slots = list(self._pool.slots)
        me = threading.current_thread()
        alive: list[Slot] = [s for s in slots if s.thread is not me]
        with closing.part("joining the slots"):
            alive = SlotPool.join(alive, deadline)
            with self._cond:
                executing = {id(entry[1]) for entry in self._pool.running.values()}
            claiming = [s for s in alive if id(s) not in executing]
            if claiming:
                # a claim in flight (blocked by a lock, a slow server): abort it; runs it
                # still returns are handed back by its thread. A handler that ignores the
                # stop gets no grace: its run is handed back now.
                self._acquirer.abort()
                abort_end = time.monotonic() + _ABORT_GRACE_SECONDS
                if grace_end is not None:
                    abort_end = min(abort_end, grace_end)
                SlotPool.join(claiming, abort_end)
                alive = [s for s in alive if s.thread.is_alive()]
        with self._cond:
            unfinished = [claimed for claimed, _, _ in self._pool.running.values()]
            waiting = self._handoff.take_all_locked()
        with closing.part("handing back runs"):
            self._hand_back(waiting, "claimed ahead and not started")
            self._hand_back(unfinished, "still executing at close")
        for slot in alive:
            log.warning(
                "runlane: %s did not stop within the close timeout; giving up on it (its run "
                "was handed back, its result will be discarded)",
                slot.name,
            )
        # the writer and the lane's delivery path share what is left of the grace
        rest = Deadline(_remaining(grace_end))
        with closing.part("the lifecycle writer"):
            self._writer.close(rest.left())
        with closing.part("the lane's delivery path"):
            self._acquirer.close(rest.left())
        if self._writer_storage is not self.storage:
            with closing.part("the writer's connection"):
                self._writer_storage.close()
        with self._cond:
            abandoned, self._pool.abandoned = self._pool.abandoned, []
        for slot in slots + abandoned:
            if slot not in alive:
                with closing.part(f"{slot.name}'s connection"):
                    slot.close_storage()
        closing.raise_first()

    def _hand_back(self, runs: Sequence[ClaimedRun], why: str) -> None:
        for claimed in runs:
            if self._tracker.untrack(claimed) is not None:
                log.info("runlane: handing run %s back (%s)", claimed.id, why)
                self._writer.release(claimed.ref)
                _telemetry.handed_back([claimed])

    def _fail(self, exc: BaseException) -> None:
        """An infrastructure failure: remember it and close the worker from a fresh thread.
        Errors once closing began (connections closed under a thread) are not failures."""
        if self._stopping.is_set():
            log.debug("runlane: %s: error while closing: %r", self.name, exc)
            return
        with self._cond:
            if self._failure is None:
                self._failure = exc
        if self._options.drain:
            self._stopping.set()
            return
        with self._close_lock:
            # a close under way finishes the job; so does a closer another slot's failure
            # started a moment ago (it may not have begun its close yet): one closer only,
            # or wait_until_closed would join the second and leave the first running
            if self._close_started or self._closer is not None:
                return
            # owned by the worker: close() and wait_until_closed() join it (bounded)
            self._closer = threading.Thread(
                target=self.close,
                kwargs={"timeout": _FAILURE_CLOSE_SECONDS},
                name=f"{self.name}-closer",
                daemon=True,
            )
            self._closer.start()

    # -- signals from the lane -------------------------------------------------------------

    def _on_cancel(self, run_id: uuid.UUID | None) -> None:
        if run_id is None:  # announcements may have been missed: look at every run now
            self._tracker.extend_soon()
            return
        for item in self._tracker.tracked():
            if item.claimed.id == run_id:
                item.cancel(StopReason.CANCEL_REQUESTED)

    # -- slots -----------------------------------------------------------------------------

    def _slot_main(self, slot: Slot) -> None:
        try:
            while not slot.abandoned:
                claimed = self._handoff.next_run(slot)
                if claimed is None:
                    return
                self._attempts.run(slot, claimed)
        except BaseException as exc:
            if not self._stopping.is_set():
                log.exception("runlane: %s failed", slot.name)
            self._fail(exc)
        finally:
            if slot.abandoned:
                self._pool.abandoned_returned(slot)
            elif self._closed.is_set():
                slot.close_storage()  # close gave up on this thread: tidy up behind it

    def _on_tick(self) -> None:
        """The writer's tick (about once a second, on its thread and connection)."""
        self._handoff.return_stale_prefetch()
        if self._watch is not None:
            self._watch.check()

    def _on_timeout(self, item: Tracked) -> None:
        """Called by the writer after failing a timed-out attempt: replace its slot."""
        self._pool.abandon(item.ref)


def check_worker_arguments(
    concurrency: object, queues: object, registered: dict[str, Queue]
) -> list[Queue]:
    """Validate create_delivery_worker's arguments; returns the queues to poll."""
    as_int("concurrency", concurrency, 1, MAX_CONCURRENCY, _CONCURRENCY_HINT)
    if queues is None:
        return list(registered.values())
    if isinstance(queues, str) or not isinstance(queues, Sequence):
        raise ConfigurationError(f"queues takes a list of queue names, got {shown(queues)}")
    names = [q.name if isinstance(q, Queue) else q for q in queues]
    unknown = sorted(str(n) for n in names if n not in registered)
    if unknown:
        raise ConfigurationError(
            f"unknown queues {unknown}: register them with create_runlane(queues=[...]) "
            f"(registered: {sorted(registered)})"
        )
    if not names:
        raise ConfigurationError("queues must name at least one queue, or be None for all")
    return [registered[str(n)] for n in dict.fromkeys(names)]
