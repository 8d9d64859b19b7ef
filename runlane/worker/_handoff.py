"""How a worker's slots get their runs: a hand-off queue, and one slot at a time becoming
the acquirer that claims for every waiting slot.

An idle slot waits for a hand-off; when no slot is acquiring, it becomes the acquirer and asks
the lane's acquirer for as many runs as there are idle slots, keeps one and hands the rest to
the others. While a backlog of quick handlers lasts it claims ahead (the prefetch) and refills
the hand-off before it runs dry; runs claimed ahead that wait too long for a slot are handed
back. When nothing is due it waits on the lane's acquirer (a wake-up or the poll interval); a
drain stops instead.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from runlane.errors import StorageUnavailable
from runlane.lanes import Acquirer
from runlane.storage import ClaimedRun
from runlane.tasks import Queue
from runlane.toolkit import Backoff
from runlane.worker._leases import LeaseTracker
from runlane.worker._lifecycle import LifecycleWriter
from runlane.worker._slots import Slot, SlotPool

__all__ = ["HandOff"]

log = logging.getLogger("runlane.worker")

# claim ahead of free slots only while handlers take less than this on average
_PREFETCH_BELOW_SECONDS = 0.02
# a run claimed ahead that waited this long for a slot is handed back
_PREFETCH_MAX_WAIT_SECONDS = 1.0


class _Waited(enum.Enum):
    """What a claim that found nothing returns once it waited for work."""

    WAITED = enum.auto()


class HandOff:
    """The runs claimed for a worker's slots and the claims that fetch them.

    Its state is guarded by the worker's condition ``cond`` (shared with the slot pool);
    methods named ``*_locked`` expect it held, the others take it."""

    def __init__(
        self,
        *,
        cond: threading.Condition,
        stopping: threading.Event,
        acquirer: Acquirer,
        tracker: LeaseTracker,
        writer: LifecycleWriter,
        pool: SlotPool,
        queues: Sequence[Queue],
        concurrency: int,
        prefetch: int,
        claim_batch: int,
        acquirers: int,
        drain: bool,
        hand_back: Callable[[Sequence[ClaimedRun], str], None],
        idle_signal: threading.Event,
    ) -> None:
        self._cond = cond
        self._stopping = stopping
        self._acquirer = acquirer
        self._tracker = tracker
        self._writer = writer
        self._pool = pool
        self._prefetch = prefetch
        self._claim_batch = claim_batch
        self._drain = drain
        self._hand_back = hand_back
        self._idle_signal = idle_signal
        self._handoff: deque[ClaimedRun] = deque()
        self._waiting = 0  # slots inside next_run, acquirers included
        self._reserved = 0  # runs being claimed right now
        self._acquiring = 0
        # one acquirer claims for every waiting slot at once: measured on 2 cores, two
        # overlapping acquirers halve the batch and double the claims for no gain
        self._max_acquirers = acquirers
        self._backlog = False
        # refill the hand-off once it holds this few runs (see _refill_due): a whole
        # prefetch, as one claim's round trip under load takes about as long as the slots
        # need to run that many quick handlers (half a prefetch ran dry: 12.3k vs 15.5k
        # runs/s, 50 vs 41 us of CPU a run)
        self._refill_below = max(concurrency, prefetch)
        # never refill (claim ahead) with a queue whose concurrency or rate is scarce
        self._bounded = not all(q.claims_ahead for q in queues)
        # a queue with any limit: a written result may free what a claim was waiting for
        self.limited = any(q.bounded for q in queues)
        self._drained = False  # drain: a claim found nothing due
        # moving average of handler durations; pessimistic until handlers have been seen
        self._handler_seconds = 1.0
        self._backoff = Backoff()

    def handler_took(self, elapsed: float) -> None:
        """A handler ran for ``elapsed`` seconds (the average that decides prefetching)."""
        self._handler_seconds += (elapsed - self._handler_seconds) * 0.1

    def take_all_locked(self) -> list[ClaimedRun]:
        """Empty the hand-off (closing): the runs claimed and not started."""
        waiting = list(self._handoff)
        self._handoff.clear()
        return waiting

    def _unserved(self) -> int:
        """Slots waiting for a run that neither the hand-off nor a claim in flight covers."""
        return self._waiting - len(self._handoff) - self._reserved

    def _wanted(self) -> int:
        """How many runs the next claim asks for: the waiting slots not yet covered, plus,
        while the last claim found a backlog and handlers are short, enough to refill the
        prefetch buffer (with long handlers a prefetched run would wait while another
        worker idles)."""
        prefetch = self._prefetch if self._backlog and self._handlers_short() else 0
        if prefetch:
            # what a refill claim tops up to: a whole claim batch above the refill mark
            prefetch += self._refill_below
        want = self._waiting + prefetch - len(self._handoff) - self._reserved
        return min(want, self._claim_batch)

    def next_run(self, slot: Slot) -> ClaimedRun | None:
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
                    # woken from a wait for work: still the acquirer, it claims again at
                    # once (leaving the place would wake another slot to take it, on the
                    # woken claim's path)
                    while isinstance(claimed, _Waited) and self._claims_again():
                        claimed = self._acquire_once(slot)
                finally:
                    with self._cond:
                        self._acquiring -= 1
                        # the acquirer's place is free: one waiting slot may take it (the
                        # claimed runs' takers were woken above; every waiter here tests the
                        # same state, so one that finds nothing to do leaves nothing for the
                        # others; closing wakes them all). Waking every idle slot made them
                        # contend for the GIL while this one claimed and started its run:
                        # 0.2 ms of an idle worker's trigger-to-start (benchmarks/README.md,
                        # issue 23, 2026-12-02 session 4)
                        self._cond.notify()
                if claimed is not None and not isinstance(claimed, _Waited):
                    return claimed
        finally:
            with self._cond:
                self._waiting -= 1

    def _claims_again(self) -> bool:
        """After a wait for work: the acquirer claims again without leaving its place
        unless the worker stops, a drain ran dry or the hand-off has a run for it."""
        with self._cond:
            return not (self._stopping.is_set() or self._drained or self._handoff)

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
        oldest = self._pool.oldest_start_locked()
        return oldest is None or time.perf_counter() - oldest < _PREFETCH_BELOW_SECONDS

    def return_stale_prefetch(self) -> None:
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

    def _acquire_once(self, slot: Slot, *, refill: bool = False) -> ClaimedRun | _Waited | None:
        """Claim for the waiting slots not yet covered; keep one run, hand off the rest.
        When nothing is due, wait for work (a drain stops instead) and return ``WAITED``.

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
        unwritten = self._writer.backlog() if self._drain else 0
        try:
            claimed = self._acquirer.acquire(want, for_bounded)
        except StorageUnavailable as exc:
            if self._stopping.is_set():
                return None
            if self._drain:
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
        self._idle_signal.set()
        if self._drain:
            if self._drain_ran_dry(unwritten):
                with self._cond:
                    self._drained = True
            return None
        if self._stopping.is_set():
            return None
        self._acquirer.wait_for_work()
        return _Waited.WAITED

    def _drain_ran_dry(self, unwritten: int) -> bool:
        """drain(), after a claim found nothing: whether nothing is left that it may start.
        Due runs a rate limit held back are waited for, and so are this drain's own results
        that were not written when the claim began (``unwritten``: a limited queue's slots
        free only once they are); the caller then claims again."""
        held = self._acquirer.rate_wait
        if held:
            self._stopping.wait(held)
            return False
        if self.limited and unwritten:
            while self._writer.backlog() and not self._stopping.wait(0.002):
                pass
            return False
        return True
