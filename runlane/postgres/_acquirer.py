"""The polling lane's delivery path: claims from Postgres, wake-ups from LISTEN.

One acquirer serves one worker (or one drain). Claims run on a connection of their own
whose commits are asynchronous (a claim lost to a server crash only makes its runs
claimable again; their handlers' later writes are fenced off). Bounded queues are claimed
first, in a rotating order so none starves, each under its queue lock (queues with a rate
limit or a per-key limit through the flow-control claim, docs/flow-control.md); the
unbounded queues share one claim. While nothing is due, ``wait_for_work`` sleeps until a
notification names one of the worker's queues, a bounded queue's capacity is freed, the
listener reconnected (it may have missed some), ``interrupt()`` is called, a rate limit
lets the next run start, the earliest delayed run of its queues comes due, or the jittered
poll interval passes.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

from runlane.errors import RunlaneClosed
from runlane.lanes import AcquirerOptions
from runlane.postgres._flow import EVERY_KEY
from runlane.postgres._listener import PostgresListener
from runlane.storage import ClaimedRun, QueueLimits, Storage

__all__ = ["PollingAcquirer"]

log = logging.getLogger("runlane.postgres.acquirer")

# a private generator: the global one belongs to the application (and to test tools)
_random = random.Random()

# While LISTEN is up, claims that find nothing for IDLE_GRACE seconds space the polls out:
# twice as long after each further empty claim, up to ten poll intervals or IDLE_CAP,
# whichever is shorter (never under the poll interval). A notification, a reconnect or a
# claim that finds work brings the poll interval back; a trigger still wakes the worker at
# once. Poll-only workers (listen=False, a listener given up behind a pooler) keep it.
# Nothing announces a delayed run when it comes due, so while polls are spaced out an empty
# claim also reads, in its transaction, how long until the earliest not-yet-due run of the
# worker's queues comes due (run_claim_or_next_due: the database's due_at - now(), one index
# descent per queue and priority), and the worker wakes no later than then (plus
# DUE_MARGIN, so the claim sees it due). A run triggered due within 15 s (IDLE_CAP with
# its jitter, and a margin) is announced (schema version 27), which brings the poll
# interval back; one due later is learnt at the next spaced-out claim, before it is due.
IDLE_GRACE = 10.0
IDLE_CAP = 10.0
DUE_MARGIN = 0.005


class PollingAcquirer:
    def __init__(
        self,
        storage: Storage,
        options: AcquirerOptions,
        on_cancel: Callable[[uuid.UUID | None], None],
        *,
        poll_interval: timedelta,
        make_listener: Callable[[Callable[[str | None], None], str], PostgresListener | None],
    ) -> None:
        self._environment = options.environment
        self._lease = options.lease
        self._worker_id = options.worker_id
        self._poll = poll_interval.total_seconds()
        self._on_cancel = on_cancel
        self._queues = {q.name for q in options.queues}
        self._unbounded = sorted(q.name for q in options.queues if not q.bounded)
        self._bounded = [q for q in options.queues if q.bounded]
        self._bounded_names = {q.name for q in self._bounded}
        self._limits = {q.name: QueueLimits.of(q) for q in self._bounded if q.limited}
        # seconds until a rate-limited queue with work held back may start a run again
        self._rate_wait: float | None = None
        self._drain = options.drain
        self._owns_storage = not options.drain
        # claims go on a connection of their own while they find work, made when needed and
        # closed once the idle backoff began (its polls go through the runtime's pool then)
        self._shared = storage
        self._own: Storage | None = None
        self._own_lock = threading.Lock()
        self._closed = False
        self._storage = storage  # where the acquire in progress claims (_claims)
        self._storage_name = options.name
        self._wake = threading.Event()
        self._idle_since: float | None = None  # monotonic time of the first empty claim
        self._empty = 0  # empty claims since the grace passed
        # monotonic time by which the earliest delayed run of the queues is due (None: none,
        # or not looked for: polls are not spaced out)
        self._next_due: float | None = None
        self._listener = (
            None if options.drain else make_listener(self._on_notify, f"{options.name}-listener")
        )

    @property
    def listener(self) -> PostgresListener | None:
        return self._listener

    def start(self) -> None:
        if self._listener is not None:
            self._listener.start()  # it says where it LISTENs once connected
        elif not self._drain:
            log.info(
                "runlane: %s polls only (listen=False): no LISTEN connection; work is found "
                "within the poll interval (%gs)",
                self._storage_name,
                self._poll,
            )

    def _on_notify(self, message: str | None) -> None:
        """``queue`` (work arrived), ``free|queue`` (capacity freed), ``cancel|<run id>``, or
        None (the listener reconnected and may have missed notifications: work, and
        cancellations, which ``on_cancel(None)`` has the worker look for at once)."""
        if message is None:
            self._idle_since, self._empty = None, 0  # it may have missed some: poll again
            self._wake.set()
            self._on_cancel(None)
            return
        kind, _, subject = message.partition("|")
        if not subject:
            if kind in self._queues:
                self._wake.set()
        elif kind == "free":
            if subject in self._bounded_names:
                self._wake.set()
        elif kind == "cancel":
            try:
                run_id = uuid.UUID(subject)
            except ValueError:
                log.debug("ignoring a malformed cancel notification %r", message)
                return
            self._on_cancel(run_id)

    def _claims(self) -> Storage:
        """Where the next claim goes: the own connection (asynchronous commits), or the
        runtime's pool while polls are spaced out (the own connection is closed then)."""
        if not self._owns_storage:
            return self._shared
        with self._own_lock:
            if self._closed:
                raise RunlaneClosed(f"{self._storage_name}-claims: the worker has shut down")
            if not self._empty:
                if self._own is None:
                    self._own = self._shared.dedicated(
                        f"{self._storage_name}-claims", durable_commits=False
                    )
                return self._own
            own, self._own = self._own, None
        if own is not None:
            own.close()
        return self._shared

    def acquire(self, want: int, for_bounded: int) -> list[ClaimedRun]:
        self._wake.clear()
        self._rate_wait = None
        self._storage = self._claims()
        claimed: list[ClaimedRun] = []
        bounded = list(self._bounded)
        _random.shuffle(bounded)
        for q in bounded:
            room = (want if q.claims_ahead else min(want, for_bounded)) - len(claimed)
            if room <= 0:
                continue
            limits = self._limits.get(q.name)
            if limits is not None:
                claimed += self._claim_limited(q.name, limits, room)
                continue
            assert q.concurrency_limit is not None
            claimed += self._storage.run_claim_bounded(
                self._environment,
                q.name,
                q.concurrency_limit,
                room,
                self._lease,
                worker_id=self._worker_id,
            )
        self._next_due = None
        if not claimed and self._spaced():
            # the unbounded claim (none: a statement that claims nothing) and, when it finds
            # nothing either, the next due time, in one transaction
            runs, due = self._storage.run_claim_or_next_due(
                self._environment,
                self._unbounded,
                want,
                self._lease,
                worker_id=self._worker_id,
                due_queues=sorted(self._queues),
            )
            claimed += runs
            if due is not None:
                # counted from the database's now, kept as a monotonic deadline here: the
                # process clock is never compared with a stored time
                self._next_due = time.monotonic() + max(0.0, due) + DUE_MARGIN
        elif self._unbounded and len(claimed) < want:
            claimed += self._storage.run_claim(
                self._environment,
                self._unbounded,
                want - len(claimed),
                self._lease,
                worker_id=self._worker_id,
            )
        self._note(bool(claimed))
        return claimed

    def _spaced(self) -> bool:
        """Whether the wait after an empty claim now is spaced out (longer than the poll
        interval): LISTEN is up and claims have found nothing for ``IDLE_GRACE``."""
        if self._drain or self._idle_since is None or not self._listening():
            return False
        return time.monotonic() - self._idle_since >= IDLE_GRACE

    def _listening(self) -> bool:
        return self._listener is not None and self._listener.connected.is_set()

    def _note(self, found: bool) -> None:
        """Count an empty claim toward the idle backoff; one that found work ends it."""
        now = time.monotonic()
        if found or self._rate_wait is not None:
            self._idle_since, self._empty = None, 0
        elif self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= IDLE_GRACE:
            self._empty += 1

    def idle_poll(self) -> float:
        """Seconds between polls now: the poll interval, or more while LISTEN is up and
        claims have found nothing for a while (``IDLE_GRACE``)."""
        if not self._listening() or not self._empty:
            return self._poll
        cap = max(self._poll, min(IDLE_CAP, 10 * self._poll))
        return min(cap, self._poll * 2.0 ** min(self._empty, 16))

    def _claim_limited(self, queue: str, limits: QueueLimits, room: int) -> list[ClaimedRun]:
        result = self._storage.run_claim_limited(
            self._environment, queue, limits, room, self._lease, worker_id=self._worker_id
        )
        if self._drain and result.walked_on:
            # the walk of a keyed queue stopped at the keys one claim may look at, none with
            # a run it may start: drain() returns only when no work is due, so it walks the
            # rest of the keys now, in one claim (a worker goes on from there at its next
            # claim instead, a poll later, keeping each claim's work bounded)
            result = self._storage.run_claim_limited(
                self._environment,
                queue,
                limits,
                room,
                self._lease,
                worker_id=self._worker_id,
                visit_limit=EVERY_KEY,
            )
        if result.rate_wait:  # the rate holds runs back: look again when it lets one start
            wait = result.rate_wait
            self._rate_wait = wait if self._rate_wait is None else min(self._rate_wait, wait)
        return result.runs

    @property
    def rate_wait(self) -> float | None:
        """Seconds until a rate limit that held runs back in the last acquire lets the next
        start (None: none did); drain() waits this long instead of stopping."""
        return self._rate_wait

    def wait_for_work(self) -> None:
        poll = self.idle_poll() * _random.uniform(0.9, 1.1)
        if self._rate_wait is not None:
            poll = min(poll, self._rate_wait)
        if self._next_due is not None:
            poll = min(poll, max(0.0, self._next_due - time.monotonic()))
        self._wake.wait(poll)

    def wait_ready(self, timeout: float) -> bool:
        """Ready once the LISTEN connection is up (at once in poll-only mode or a drain, and
        once the listener gave LISTEN up behind a pooler: it polls)."""
        if self._listener is None:
            return True
        deadline = time.monotonic() + timeout
        while not self._listener.connected.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if self._listener.gave_up.is_set():
                return True
            if time.monotonic() >= deadline:
                return False
        return True

    def interrupt(self) -> None:
        self._wake.set()

    def abort(self) -> None:
        with self._own_lock:
            own = self._own
        if own is not None:
            own.interrupt()

    def close(self, timeout: float | None) -> None:
        self._wake.set()
        if self._listener is not None:
            self._listener.close(timeout)
        with self._own_lock:
            self._closed = True
            own, self._own = self._own, None
        if own is not None:
            own.close()
