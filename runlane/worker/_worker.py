"""The delivery worker: handler slots, acquisition, wake-ups and a lifecycle writer.

Threads of one worker (``W`` is its number in this process):

- ``runlane-worker-W-slot-I`` (``concurrency`` of them) run handlers; each has its own
  connection for its handler's steps, waits, sleeps and releases. An idle slot waits for a
  hand-off; when no slot is acquiring, it becomes the acquirer and claims, on the worker's
  claim connection, as many runs as there are idle slots (``FOR UPDATE SKIP LOCKED``), keeps
  one and hands the rest to the others. When nothing is due it waits for a wake-up or the
  poll interval.
- ``runlane-worker-W-writer`` writes completions, failures, hand-backs and lease extensions in
  batches, on its own connection, and fails attempts that pass their task's timeout.
- ``runlane-worker-W-listener`` holds a LISTEN connection; notifications wake the acquirer.

A slot whose handler passed its timeout is abandoned (its thread finishes the handler, whose
result is discarded) and a fresh slot takes its place, so capacity stays ``concurrency``.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import attrs
import psycopg

from runlane._backoff import Backoff
from runlane._execution import execute_attempt, make_context
from runlane._leases import LeaseTracker, Tracked
from runlane.context import ContextBackend
from runlane.errors import ConfigurationError, WorkerFailed
from runlane.storage import ClaimedRun, LeaseRef, Storage
from runlane.tasks import Queue, Task
from runlane.worker._lifecycle import LifecycleStats, LifecycleWriter

__all__ = ["Listener", "Worker", "WorkerOptions"]

# a private generator: the global one belongs to the application (and to test tools)
_random = random.Random()

log = logging.getLogger("runlane.worker")

_numbers = itertools.count(1)
# claim ahead of free slots only while handlers take less than this on average
_PREFETCH_BELOW_SECONDS = 0.02
# a run claimed ahead that waited this long for a slot is handed back
_PREFETCH_MAX_WAIT_SECONDS = 1.0


class Listener(Protocol):
    def start(self) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...


@attrs.frozen
class WorkerOptions:
    concurrency: int
    poll_interval: timedelta
    lease: timedelta
    claim_batch: int
    prefetch: int = 0  # runs claimed ahead of free slots while a backlog lasts
    acquirers: int = 1


class _Slot:
    def __init__(self, worker: Worker, index: int) -> None:
        self.index = index
        self.name = f"{worker.name}-slot-{index}"
        self.storage: Storage = worker.storage.dedicated(self.name)
        self.backend = worker._make_backend(self.storage)
        self.abandoned = False
        self.thread = threading.Thread(target=worker._slot_main, args=(self,), name=self.name)
        self.thread.daemon = True


class Worker:
    """Executes runs of the given queues in ``concurrency`` threads until closed.

    Make one with :meth:`Runlane.create_delivery_worker`. ``close()`` stops acquisition,
    sets ``context.cancelled`` for running handlers, waits for them up to its timeout, hands
    unfinished runs back for another worker, flushes pending writes and closes connections.
    """

    def __init__(
        self,
        *,
        storage: Storage,
        environment: str,
        tasks: dict[str, Task[Any, Any]],
        queues: Sequence[Queue],
        options: WorkerOptions,
        make_listener: Callable[[Callable[[str | None], None], str], Listener | None],
        make_backend: Callable[[Storage], ContextBackend],
    ) -> None:
        self.name = f"runlane-worker-{next(_numbers)}"
        self.storage = storage
        self.environment = environment
        self._tasks = tasks
        self._options = options
        self._queue_names = {q.name for q in queues}
        self._unbounded = sorted(q.name for q in queues if q.concurrency_limit is None)
        self._bounded = [q for q in queues if q.concurrency_limit is not None]
        self._cond = threading.Condition()
        self._handoff: deque[ClaimedRun] = deque()
        self._waiting = 0  # slots inside _next_run, acquirers included
        self._reserved = 0  # runs being claimed right now
        self._acquiring = 0
        # one acquirer claims for every waiting slot at once: measured on 2 cores, two
        # overlapping acquirers halve the batch and double the claims for no gain
        self._max_acquirers = options.acquirers
        self._backlog = False
        # moving average of handler durations; pessimistic until handlers have been seen
        self._handler_seconds = 1.0
        self._backoff = Backoff()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self._close_started = False
        self._failure: BaseException | None = None
        self._slots: list[_Slot] = []
        self._abandoned: list[_Slot] = []
        self._running: dict[Any, tuple[ClaimedRun, _Slot, float]] = {}
        self._slot_numbers = itertools.count(1)
        self.runs_executed = 0
        # test hook: set when a claim found nothing due
        self.idle_signal = threading.Event()
        self._tracker = LeaseTracker(options.lease)
        self._writer_storage = storage.dedicated(f"{self.name}-writer")
        # claims commit asynchronously: a claim lost to a server crash only returns its runs
        # to the queue (their handlers' later writes are fenced off); the acquirer uses it
        self._claim_storage = storage.dedicated(f"{self.name}-claims", synchronous_commit=False)
        self._writer = LifecycleWriter(
            self._writer_storage,
            self._tracker,
            environment=environment,
            name=f"{self.name}-writer",
            on_timeout=self._on_timeout,
            on_fatal=self._fail,
            # freed capacity of a bounded queue: let the acquirer look again at once
            on_written=self._wake.set if self._bounded else None,
            wake_queues=[q.name for q in self._bounded],
            on_tick=self._return_stale_prefetch,
        )
        self._listener = make_listener(self._on_wake, f"{self.name}-listener")
        self._make_backend = make_backend

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._writer.start()
        if self._listener is not None:
            self._listener.start()
        with self._cond:
            for _ in range(self._options.concurrency):
                self._start_slot()

    def _start_slot(self) -> None:
        slot = _Slot(self, next(self._slot_numbers))
        self._slots.append(slot)
        slot.thread.start()

    @property
    def stats(self) -> LifecycleStats:
        return self._writer.stats

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_until_closed(self, timeout: float | None = None) -> bool:
        """Block until the worker is closed (by ``close`` or by a failure); observes only.

        Returns False when ``timeout`` passed first. Raises :class:`WorkerFailed` when a slot
        failed for infrastructure reasons (a handler's exception is a run failure instead).
        """
        if not self._closed.wait(timeout):
            return False
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
        ``context.cancelled`` is set; runs still executing then are handed back.
        """
        with self._close_lock:
            first = not self._close_started
            self._close_started = True
        if not first:
            self._closed.wait(timeout)
            return
        try:
            self._shutdown(timeout)
        finally:
            self._closed.set()

    def _shutdown(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._stopping.set()
        self._wake.set()
        with self._cond:
            self._cond.notify_all()
            slots = list(self._slots)
        for item in self._tracker.tracked():
            item.cancel()
        for slot in slots:
            if slot.thread is threading.current_thread():
                continue
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            slot.thread.join(remaining)
        with self._cond:
            unfinished = list(self._running.values())
            # claimed ahead of slots that stopped before taking them
            for claimed in self._handoff:
                if self._tracker.untrack(claimed.id) is not None:
                    self._writer.release(_ref(claimed))
            self._handoff.clear()
        for claimed, _, _ in unfinished:
            if self._tracker.untrack(claimed.id) is not None:
                log.warning(
                    "run %s is still executing at close; handing it back for another worker",
                    claimed.id,
                )
                self._writer.release(_ref(claimed))
        remaining = None if deadline is None else max(1.0, deadline - time.monotonic())
        self._writer.close(remaining)
        if self._listener is not None:
            self._listener.close(remaining)
        self._writer_storage.close()
        self._claim_storage.close()
        for slot in slots + self._abandoned:
            slot.storage.close()

    def _fail(self, exc: BaseException) -> None:
        """An infrastructure failure: remember it and close the worker from a fresh thread."""
        with self._cond:
            if self._failure is None:
                self._failure = exc
        if not self._stopping.is_set():
            threading.Thread(
                target=self.close,
                kwargs={"timeout": 30.0},
                name=f"{self.name}-closer",
                daemon=True,
            ).start()

    # -- wake-ups --------------------------------------------------------------------------

    def _on_wake(self, message: str | None) -> None:
        """A notification: ``queue`` (work arrived), ``cancel|<run id>``, or None (the
        listener reconnected and may have missed some)."""
        if message is not None and message.startswith("cancel|"):
            run_id = message.partition("|")[2]
            for item in self._tracker.tracked():
                if str(item.claimed.id) == run_id:
                    item.cancel()
            return
        if message is None or message in self._queue_names:
            self._wake.set()

    # -- slots -----------------------------------------------------------------------------

    def _slot_main(self, slot: _Slot) -> None:
        try:
            while not slot.abandoned:
                claimed = self._next_run(slot)
                if claimed is None:
                    return
                self._execute(slot, claimed)
        except BaseException as exc:
            log.exception("runlane: %s failed", slot.name)
            self._fail(exc)

    def _unserved(self) -> int:
        """Slots waiting for a run that neither the hand-off nor a claim in flight covers."""
        return self._waiting - len(self._handoff) - self._reserved

    def _wanted(self) -> int:
        """How many runs the next claim asks for: the waiting slots not yet covered, plus,
        while the last claim found a backlog and handlers are short, enough to refill the
        prefetch buffer (with long handlers a prefetched run would wait while another
        worker idles)."""
        prefetch = self._options.prefetch if self._backlog and self._handlers_short() else 0
        want = self._waiting + prefetch - len(self._handoff) - self._reserved
        return min(want, self._options.claim_batch)

    def _next_run(self, slot: _Slot) -> ClaimedRun | None:
        """The next run for ``slot``: from the hand-off, or by becoming an acquirer and
        claiming for every waiting slot; None once the worker stops."""
        with self._cond:
            self._waiting += 1
        try:
            while True:
                with self._cond:
                    while True:
                        if self._stopping.is_set():
                            return None
                        if self._handoff:
                            return self._handoff.popleft()
                        if self._acquiring < self._max_acquirers and self._unserved() > 0:
                            self._acquiring += 1
                            break
                        self._cond.wait(timeout=1.0)
                try:
                    claimed = self._acquire_once(slot)
                finally:
                    with self._cond:
                        self._acquiring -= 1
                        self._cond.notify_all()
                if claimed is not None:
                    return claimed
        finally:
            with self._cond:
                self._waiting -= 1

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
        ids = {item.claimed.id for item in stale}
        with self._cond:
            returned = [run for run in self._handoff if run.id in ids]
            self._handoff = deque(run for run in self._handoff if run.id not in ids)
        for run in returned:
            if self._tracker.untrack(run.id) is not None:
                self._writer.release(_ref(run))

    def _acquire_once(self, slot: _Slot) -> ClaimedRun | None:
        """Claim for the waiting slots not yet covered; keep one run, hand off the rest.
        When nothing is due, wait for a wake-up or the poll interval and return None."""
        with self._cond:
            want = self._wanted()
            if want <= 0:
                return None
            # bounded queues never prefetch: a waiting lease would hold a scarce slot
            for_bounded = max(1, min(want, self._unserved()))
            self._reserved += want
        self._wake.clear()
        try:
            claimed = self._claim(self._claim_storage, want, for_bounded)
        except psycopg.OperationalError as exc:
            log.warning("runlane: %s could not claim (%s); retrying", slot.name, exc)
            self._stopping.wait(self._backoff.next())
            return None
        finally:
            with self._cond:
                self._reserved -= want
        self._backoff.reset()
        self._backlog = len(claimed) == want
        for run in claimed:
            self._tracker.hold(run)  # leases are kept from the claim on
        if claimed:
            if len(claimed) > 1:
                with self._cond:
                    self._handoff.extend(claimed[1:])
                    self._cond.notify(len(claimed) - 1)
            return claimed[0]
        self.idle_signal.set()
        if self._stopping.is_set():  # close() may have set the wake-up before our clear()
            return None
        poll = self._options.poll_interval.total_seconds()
        self._wake.wait(poll * _random.uniform(0.9, 1.1))
        return None

    def _claim(self, storage: Storage, want: int, for_bounded: int) -> list[ClaimedRun]:
        lease = self._options.lease
        claimed: list[ClaimedRun] = []
        # bounded queues first, in a rotating order, so no bounded queue starves
        bounded = list(self._bounded)
        _random.shuffle(bounded)
        for q in bounded:
            room = min(want, for_bounded) - len(claimed)
            if room <= 0:
                break
            assert q.concurrency_limit is not None
            claimed += storage.run_claim_bounded(
                self.environment, q.name, q.concurrency_limit, room, lease
            )
        if self._unbounded and len(claimed) < want:
            claimed += storage.run_claim(
                self.environment, self._unbounded, want - len(claimed), lease
            )
        return claimed

    def _execute(self, slot: _Slot, claimed: ClaimedRun) -> None:
        if self._stopping.is_set():
            # claimed just before close: give it straight back
            if self._tracker.untrack(claimed.id) is not None:
                self._writer.release(_ref(claimed))
            return
        context = make_context(claimed, self.environment, slot.backend)
        task = self._tasks.get(claimed.task_id)
        if not self._tracker.begin(claimed, context, task):
            log.warning("run %s lost its lease while waiting for a slot; skipped", claimed.id)
            return
        started = time.perf_counter()
        with self._cond:
            self._running[claimed.id] = (claimed, slot, started)
        try:
            outcome = execute_attempt(claimed, self._tasks, context)
        finally:
            elapsed = time.perf_counter() - started
            self._handler_seconds += (elapsed - self._handler_seconds) * 0.1
            with self._cond:
                self._running.pop(claimed.id, None)
            still_ours = self._tracker.untrack(claimed.id) is not None
        self.runs_executed += outcome.handler_ran
        if outcome.write is None:
            return  # suspended: its write was made on the slot's connection
        if still_ours:
            self._writer.submit(outcome.write)
        else:
            log.info(
                "run %s attempt %d finished after it was taken from this worker; "
                "its result is discarded",
                claimed.id,
                claimed.attempt,
            )

    def _on_timeout(self, item: Tracked) -> None:
        """Called by the writer after failing a timed-out attempt: replace its slot."""
        with self._cond:
            entry = self._running.get(item.claimed.id)
            if entry is None or self._stopping.is_set():
                return
            slot = entry[1]
            slot.abandoned = True
            self._slots.remove(slot)
            self._abandoned.append(slot)
            self._start_slot()


def _ref(claimed: ClaimedRun) -> LeaseRef:
    return LeaseRef(claimed.id, claimed.attempt, claimed.lease_token)


def check_worker_arguments(
    concurrency: object, queues: object, registered: dict[str, Queue]
) -> list[Queue]:
    """Validate create_delivery_worker's arguments; returns the queues to poll."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigurationError(f"concurrency must be a positive integer, got {concurrency!r}")
    if queues is None:
        return list(registered.values())
    if isinstance(queues, str) or not isinstance(queues, Sequence):
        raise ConfigurationError(f"queues takes a list of queue names, got {queues!r}")
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
