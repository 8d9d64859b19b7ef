"""The delivery worker: a lane-agnostic slot pool, the lane's acquirer and a lifecycle writer.

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

A slot whose handler passed its timeout is abandoned (its thread finishes the handler, whose
result is discarded; its connection closes when it does) and a fresh slot takes its place,
so capacity stays ``concurrency``; past ``concurrency`` abandoned slots still running, none
is replaced until one returns, so handlers that ignore their timeout cannot exhaust the
process's threads and the server's connections.

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
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import attrs

from runlane import _telemetry
from runlane._attempt import AttemptControl
from runlane._backoff import Backoff
from runlane._closing import Closing, Deadline
from runlane._display import shown
from runlane._limits import MAX_CONCURRENCY, as_int, as_wait_timeout, output_limit
from runlane._middleware import Middleware
from runlane._workers import new_beat
from runlane.context import ContextBackend, RunContext
from runlane.errors import ConfigurationError, StopReason, StorageUnavailable, WorkerFailed
from runlane.lanes import Acquirer, AcquirerOptions, Lane
from runlane.models import WorkerState
from runlane.storage import ClaimedRun, LeaseRef, Storage
from runlane.tasks import Queue, Task
from runlane.worker._execution import Write, execute_attempt, make_context
from runlane.worker._failure_log import log_failure
from runlane.worker._leases import LeaseTracker, Tracked
from runlane.worker._lifecycle import LifecycleStats, LifecycleWriter
from runlane.worker._watch import MaintenanceWatch

__all__ = ["Worker", "WorkerOptions", "check_worker_arguments"]

log = logging.getLogger("runlane.worker")

_numbers = itertools.count(1)
# claim ahead of free slots only while handlers take less than this on average
_PREFETCH_BELOW_SECONDS = 0.02
# a run claimed ahead that waited this long for a slot is handed back
_PREFETCH_MAX_WAIT_SECONDS = 1.0
# after close's deadline: how long an aborted claim in flight gets to return its runs
_ABORT_GRACE_SECONDS = 0.5
# drain(stop=...): how often the stop event is looked at while a handler runs
_STOP_POLL_SECONDS = 0.02
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


class _Slot:
    def __init__(self, worker: Worker, index: int) -> None:
        self.index = index
        self.name = f"{worker.name}-slot-{index}"
        self.inline = worker._options.drain
        self.storage: Storage = (
            worker.storage if self.inline else worker.storage.dedicated(self.name)
        )
        self.backend = worker._make_backend(self.storage)
        self.abandoned = False
        self.thread = threading.Thread(target=worker._slot_main, args=(self,), name=self.name)
        self.thread.daemon = True

    def close_storage(self) -> None:
        if not self.inline:
            self.storage.close()


class _StopWatcher:
    """drain(stop=...): a thread that turns ``stop`` being set into ``stop_acquiring()``
    (the running handler is asked to stop) while drain executes in the caller's thread.
    A ``threading.Event`` offers no callback, so the thread looks at it every
    ``_STOP_POLL_SECONDS``; it ends when drain does."""

    def __init__(self, worker: Worker, stop: threading.Event) -> None:
        self._worker = worker
        self._stop = stop
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._main, name=f"{worker.name}-stop-watch", daemon=True
        )
        self._thread.start()

    def _main(self) -> None:
        while not self._done.is_set():
            if self._stop.wait(_STOP_POLL_SECONDS):
                if not self._done.is_set():
                    self._worker.stop_acquiring()
                return

    def close(self) -> None:
        self._done.set()
        self._thread.join(_STOP_POLL_SECONDS + 1.0)


def _remaining(deadline: float | None, floor: float = 0.0) -> float | None:
    return None if deadline is None else max(floor, deadline - time.monotonic())


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
        self._tasks = tasks
        self._middleware = tuple(middleware)
        self._options = options
        self._make_backend = make_backend
        self._on_closed = on_closed
        self._cond = threading.Condition()
        self._handoff: deque[ClaimedRun] = deque()
        self._waiting = 0  # slots inside _next_run, acquirers included
        self._reserved = 0  # runs being claimed right now
        self._acquiring = 0
        # one acquirer claims for every waiting slot at once: measured on 2 cores, two
        # overlapping acquirers halve the batch and double the claims for no gain
        self._max_acquirers = options.acquirers
        self._backlog = False
        # refill the hand-off once it holds this few runs (see _refill_due): a whole
        # prefetch, as one claim's round trip under load takes about as long as the slots
        # need to run that many quick handlers (half a prefetch ran dry: 12.3k vs 15.5k
        # runs/s, 50 vs 41 us of CPU a run)
        self._refill_below = max(options.concurrency, options.prefetch)
        # never refill (claim ahead) with a queue whose concurrency or rate is scarce
        self._bounded = not all(q.claims_ahead for q in queues)
        # a queue with any limit: a written result may free what a claim was waiting for
        self._limited = any(q.bounded for q in queues)
        self._drained = False  # drain: a claim found nothing due
        # moving average of handler durations; pessimistic until handlers have been seen
        self._handler_seconds = 1.0
        self._backoff = Backoff()
        self._stopping = threading.Event()
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self._close_started = False
        self._closer: threading.Thread | None = None  # closes the worker after a failure
        self._failure: BaseException | None = None
        self._slots: list[_Slot] = []
        self._abandoned: list[_Slot] = []
        self._running: dict[LeaseRef, tuple[ClaimedRun, _Slot, float]] = {}
        self._slot_numbers = itertools.count(1)
        self.runs_executed = 0
        # drain only (one thread): attempts by outcome (see _telemetry.outcome_kind)
        self.outcomes: dict[str, int] = {}
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
        self._writer_storage = (
            storage if options.drain else storage.dedicated(f"{self.name}-writer")
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
            on_written=self._acquirer.interrupt if self._limited else None,
            on_tick=self._on_tick,
            late_storage=storage,
            beat=beat,
        )

        self._watch = None if options.drain else MaintenanceWatch(self._writer_storage, environment)

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
                self._start_slot()

    def _start_slot(self) -> None:
        slot = _Slot(self, next(self._slot_numbers))
        try:
            slot.thread.start()  # RuntimeError when the process is out of threads
        except BaseException:
            slot.close_storage()
            raise
        self._slots.append(slot)  # only a started thread: close() joins every slot

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
        slot = _Slot(self, 1)
        watcher = None if stop is None else _StopWatcher(self, stop)
        try:
            while max_runs is None or self.runs_executed < max_runs:
                if stop is not None and stop.is_set():
                    break
                claimed = self._next_run(slot)
                if claimed is None:
                    break
                self._execute(slot, claimed)
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
        if not self._closed.wait(deadline.left()):
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
        unspent. Returns within ``timeout`` plus about a second whatever blocks.
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
        closing = Closing(self.name)
        with closing.part("asking to stop"):
            self.stop_acquiring()
        with self._cond:
            slots = list(self._slots)
        me = threading.current_thread()
        alive: list[_Slot] = [s for s in slots if s.thread is not me]
        with closing.part("joining the slots"):
            alive = self._join(alive, deadline)
            with self._cond:
                executing = {id(entry[1]) for entry in self._running.values()}
            claiming = [s for s in alive if id(s) not in executing]
            if claiming:
                # a claim in flight (blocked by a lock, a slow server): abort it; runs it
                # still returns are handed back by its thread. A handler that ignores the
                # stop gets no grace: its run is handed back now.
                self._acquirer.abort()
                self._join(claiming, time.monotonic() + _ABORT_GRACE_SECONDS)
                alive = [s for s in alive if s.thread.is_alive()]
        with self._cond:
            unfinished = [claimed for claimed, _, _ in self._running.values()]
            waiting = list(self._handoff)
            self._handoff.clear()
        with closing.part("handing back runs"):
            self._hand_back(waiting, "claimed ahead and not started")
            self._hand_back(unfinished, "still executing at close")
        for slot in alive:
            log.warning(
                "runlane: %s did not stop within the close timeout; giving up on it (its run "
                "was handed back, its result will be discarded)",
                slot.name,
            )
        # the writer and the lane's delivery path share what is left, or one short grace
        # past the deadline (a write to cancel, a listener to stop): not a grace each
        rest = Deadline(_remaining(deadline, floor=_ABORT_GRACE_SECONDS))
        with closing.part("the lifecycle writer"):
            self._writer.close(rest.left())
        with closing.part("the lane's delivery path"):
            self._acquirer.close(rest.left())
        if self._writer_storage is not self.storage:
            with closing.part("the writer's connection"):
                self._writer_storage.close()
        with self._cond:
            abandoned, self._abandoned = self._abandoned, []
        for slot in slots + abandoned:
            if slot not in alive:
                with closing.part(f"{slot.name}'s connection"):
                    slot.close_storage()
        closing.raise_first()

    @staticmethod
    def _join(slots: list[_Slot], deadline: float | None) -> list[_Slot]:
        for slot in slots:
            slot.thread.join(_remaining(deadline))
        return [slot for slot in slots if slot.thread.is_alive()]

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

    def _on_cancel(self, run_id: uuid.UUID) -> None:
        for item in self._tracker.tracked():
            if item.claimed.id == run_id:
                item.cancel(StopReason.CANCEL_REQUESTED)

    # -- slots -----------------------------------------------------------------------------

    def _slot_main(self, slot: _Slot) -> None:
        try:
            while not slot.abandoned:
                claimed = self._next_run(slot)
                if claimed is None:
                    return
                self._execute(slot, claimed)
        except BaseException as exc:
            if not self._stopping.is_set():
                log.exception("runlane: %s failed", slot.name)
            self._fail(exc)
        finally:
            if slot.abandoned:
                self._abandoned_returned(slot)
            elif self._closed.is_set():
                slot.close_storage()  # close gave up on this thread: tidy up behind it

    def _unserved(self) -> int:
        """Slots waiting for a run that neither the hand-off nor a claim in flight covers."""
        return self._waiting - len(self._handoff) - self._reserved

    def _wanted(self) -> int:
        """How many runs the next claim asks for: the waiting slots not yet covered, plus,
        while the last claim found a backlog and handlers are short, enough to refill the
        prefetch buffer (with long handlers a prefetched run would wait while another
        worker idles)."""
        prefetch = self._options.prefetch if self._backlog and self._handlers_short() else 0
        if prefetch:
            # what a refill claim tops up to: a whole claim batch above the refill mark
            prefetch += self._refill_below
        want = self._waiting + prefetch - len(self._handoff) - self._reserved
        return min(want, self._options.claim_batch)

    def _next_run(self, slot: _Slot) -> ClaimedRun | None:
        """The next run for ``slot``: from the hand-off, or by becoming the acquirer and
        claiming for every waiting slot; None once the worker stops (or a drain ran dry)."""
        with self._cond:
            self._waiting += 1
        try:
            while True:
                with self._cond:
                    while True:
                        if self._stopping.is_set() or self._drained:
                            return None
                        refill = self._refill_due()
                        if self._handoff and not refill:
                            return self._handoff.popleft()
                        if self._acquiring < self._max_acquirers and (
                            refill or self._unserved() > 0
                        ):
                            self._acquiring += 1
                            break
                        self._cond.wait(timeout=1.0)
                try:
                    claimed = self._acquire_once(slot, refill=refill)
                finally:
                    with self._cond:
                        self._acquiring -= 1
                        self._cond.notify_all()
                if claimed is not None:
                    return claimed
        finally:
            with self._cond:
                self._waiting -= 1

    def _refill_due(self) -> bool:
        """Claim ahead now, while the hand-off still holds runs: a backlog of quick handlers
        would otherwise leave every slot idle for the claim's round trip each time the
        hand-off runs dry. Only with the lock held; never for bounded queues."""
        return (
            self._backlog
            and not self._bounded
            and self._acquiring < self._max_acquirers
            and 0 < len(self._handoff) + self._reserved <= self._refill_below
            and self._handlers_short()
        )

    def _handlers_short(self) -> bool:
        """Handlers have been quick on average, and none running now has been slow."""
        if self._handler_seconds >= _PREFETCH_BELOW_SECONDS:
            return False
        oldest = min((started for _, _, started in self._running.values()), default=None)
        return oldest is None or time.perf_counter() - oldest < _PREFETCH_BELOW_SECONDS

    def _return_stale_prefetch(self) -> None:
        """Hand back runs claimed ahead that have waited too long for a slot (handlers turned
        slow), so an idle worker elsewhere can take them."""
        stale = self._tracker.held_since(time.monotonic() - _PREFETCH_MAX_WAIT_SECONDS)
        if not stale:
            return
        refs = {item.ref for item in stale}
        with self._cond:
            returned = [run for run in self._handoff if run.ref in refs]
            self._handoff = deque(run for run in self._handoff if run.ref not in refs)
        self._hand_back(returned, "waited too long for a slot")

    def _acquire_once(self, slot: _Slot, *, refill: bool = False) -> ClaimedRun | None:
        """Claim for the waiting slots not yet covered; keep one run, hand off the rest.
        When nothing is due, wait for work (a drain stops instead) and return None.

        A ``refill`` claim (see ``_refill_due``) tops the hand-off up: the claimed runs go
        behind the ones already there and the slot takes the oldest, and finding nothing
        due returns None without waiting (the hand-off still has work)."""
        with self._cond:
            want = self._wanted()
            if want <= 0:
                return None
            # bounded queues never prefetch: a waiting lease would hold a scarce slot
            for_bounded = max(0 if refill else 1, min(want, self._unserved()))
            self._reserved += want
        sent_at = time.monotonic()
        # drain: results not yet written when the claim began may free what it counted
        unwritten = self._writer.backlog() if self._options.drain else 0
        try:
            claimed = self._acquirer.acquire(want, for_bounded)
        except StorageUnavailable as exc:
            if self._stopping.is_set():
                return None
            if self._options.drain:
                raise
            log.warning("runlane: %s could not claim (%s); retrying", slot.name, exc)
            self._stopping.wait(self._backoff.next())
            return None
        finally:
            with self._cond:
                self._reserved -= want
        self._backoff.reset()
        self._backlog = len(claimed) == want
        self._tracker.hold_all(claimed, sent_at=sent_at)  # leases are kept from the claim on
        if claimed:
            with self._cond:
                late = self._stopping.is_set()
                if not late:
                    self._handoff.extend(claimed)
                    mine = self._handoff.popleft()
                    self._cond.notify(len(claimed) - 1)
            if late:  # a claim that returned after close began: give every run back
                self._hand_back(claimed, "claimed while the worker was closing")
                return None
            return mine
        if refill:
            return None
        self.idle_signal.set()
        if self._options.drain:
            if self._drain_ran_dry(unwritten):
                with self._cond:
                    self._drained = True
            return None
        if not self._stopping.is_set():
            self._acquirer.wait_for_work()
        return None

    def _drain_ran_dry(self, unwritten: int) -> bool:
        """drain(), after a claim found nothing: whether nothing is left that it may start.
        Due runs a rate limit held back are waited for, and so are this drain's own results
        that were not written when the claim began (``unwritten``: a limited queue's slots
        free only once they are); the caller then claims again."""
        held = self._acquirer.rate_wait
        if held:
            self._stopping.wait(held)
            return False
        if self._limited and unwritten:
            while self._writer.backlog() and not self._stopping.wait(0.002):
                pass
            return False
        return True

    def _start(self, slot: _Slot, claimed: ClaimedRun) -> tuple[RunContext, AttemptControl] | None:
        """The context a claimed run starts with, and the engine's side of it; None when it
        must not start."""
        if self._stopping.is_set():
            # claimed just before close: give it straight back
            self._hand_back([claimed], "claimed just before close")
            return None
        checked_at = time.monotonic()
        if self._tracker.lapsed(claimed, checked_at):
            # this process was paused (or its extensions failed) since the claim: the lease
            # may have lapsed and the attempt been expired, the run or its queue slot taken
            # by another worker. Hand it back (fenced: refused if it is no longer ours).
            log.warning(
                "run %s attempt %d: its lease (%s) was not confirmed for too long since the "
                "claim (was this process paused?); not starting it",
                claimed.id,
                claimed.attempt,
                self._options.lease,
            )
            self._hand_back([claimed], "its lease may have lapsed before it started")
            return None
        # report_progress goes with the writer's batches
        control = AttemptControl(progress_sink=self._writer, lease_checked_at=checked_at)
        context = make_context(claimed, self.environment, slot.backend, control)
        task = self._tasks.get(claimed.task_id)
        if not self._tracker.begin(claimed, control, task):
            log.warning("run %s lost its lease while waiting for a slot; skipped", claimed.id)
            return None
        return context, control

    def _execute(self, slot: _Slot, claimed: ClaimedRun) -> None:
        started_with = self._start(slot, claimed)
        if started_with is None:
            return
        context, control = started_with
        attempt = _telemetry.begin_attempt(claimed, self._options.lease)
        started = time.perf_counter()
        with self._cond:
            self._running[claimed.ref] = (claimed, slot, started)
        try:
            outcome = execute_attempt(
                claimed,
                self._tasks,
                context,
                self._middleware,
                lambda failed: log_failure(claimed, failed, time.perf_counter() - started),
                control=control,
                max_output=output_limit(slot.backend),
            )
        except BaseException as exc:
            if attempt is not None:
                attempt.abort(exc)
            raise
        finally:
            elapsed = time.perf_counter() - started
            self._handler_seconds += (elapsed - self._handler_seconds) * 0.1
            with self._cond:
                self._running.pop(claimed.ref, None)
            still_ours = self._tracker.untrack(claimed) is not None
        self.runs_executed += outcome.handler_ran
        if attempt is not None or self._options.drain:
            kind = _telemetry.outcome_kind(outcome, context)
            if not still_ours and outcome.write is not None:
                kind = _telemetry.DISCARDED
            if self._options.drain:
                self.outcomes[kind] = self.outcomes.get(kind, 0) + 1
            if attempt is not None:
                attempt.end(kind, outcome, elapsed)
        if outcome.write is None:
            return  # suspended (written on the slot's connection), timed out or lease lost
        if still_ours:
            self._submit(outcome.write)
        else:
            log.info(
                "run %s attempt %d finished after it was taken from this worker; "
                "its result is discarded",
                claimed.id,
                claimed.attempt,
            )

    def _on_tick(self) -> None:
        """The writer's tick (about once a second, on its thread and connection)."""
        self._return_stale_prefetch()
        if self._watch is not None:
            self._watch.check()

    def _submit(self, write: Write) -> None:
        if isinstance(write, LeaseRef):
            self._writer.release(write)
        else:
            self._writer.submit(write)

    def _on_timeout(self, item: Tracked) -> None:
        """Called by the writer after failing a timed-out attempt: replace its slot."""
        with self._cond:
            entry = self._running.get(item.ref)
            if entry is None or self._stopping.is_set() or self._options.drain:
                return
            slot = entry[1]
            slot.abandoned = True
            self._slots.remove(slot)
            self._abandoned.append(slot)
            if len(self._abandoned) <= self._options.concurrency:
                self._start_slot()
                return
            # each abandoned slot holds a thread and a connection until its handler
            # returns: past one per slot, capacity shrinks rather than exhaust the server
            log.error(
                "runlane: %s: %d handlers are still running past their timeout (they ignore "
                "context.cancelled); %s is not replaced until one of them returns",
                self.name,
                len(self._abandoned),
                slot.name,
            )

    def _abandoned_returned(self, slot: _Slot) -> None:
        """An abandoned slot's handler returned: its connection goes, and a slot withheld
        for it starts."""
        with self._cond:
            if slot not in self._abandoned:
                return  # close() took it
            self._abandoned.remove(slot)
            # a slot withheld while too many were abandoned starts now
            if len(self._slots) < self._options.concurrency and not self._stopping.is_set():
                self._start_slot()
        slot.close_storage()


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
