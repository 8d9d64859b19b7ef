"""Group commit for triggers: concurrent ``trigger()`` calls share statements and commits.

A call that finds nothing in flight and nobody queued writes its run at once, alone. A call
that arrives while a statement is in flight queues; when that statement ends, the first
queued call leads the next one, writing every queued call's run (up to ``max_group``) in one
statement and commit. No thread is started: callers' own threads take turns leading.

The leader first holds briefly for the callers of the statement that just committed:
threads that trigger in a loop call again at once, and without the hold a crowd splits into
two halves taking turns (_gather, _learn_pace). A lone caller holds no one (_write_alone).

Every call returns once the statement holding its run has committed. A failed shared
statement wrote nothing (one autocommit statement), so each of its calls writes again
alone: one bad row fails its own call only. Ids are made by the client, so a group that
committed but lost its answer is found again by those retries. While it waits, a call
turns its run into one JSON object (``group_row``), and followers wake one another
(_pass_on), keeping the leader's path between two statements short.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence

from runlane.storage import InsertedRun, NewRuns

__all__ = ["MAX_GROUP", "GroupCommit", "group_row", "group_rows", "groupable"]

log = logging.getLogger("runlane.postgres")

#: A call joins groups when its payload and key are at most this many characters, so a full
#: group stays within ``_batches.STATEMENT_BYTES`` (4 bytes a character).
GROUP_ROW_CHARS = 16 * 1024
MAX_GROUP = 256
#: The hold (_hand_over): COME_BACK_MARGIN x calls awaited x their past pace, within
#: [HOLD_FRACTION, HOLD_STATEMENTS] x the statement's time, at most MAX_HOLD seconds.
HOLD_FRACTION = 0.25
HOLD_STATEMENTS = 2.0
MAX_HOLD = 0.005
COME_BACK_MARGIN = 2.0

Alone = Callable[[NewRuns], list[InsertedRun]]
#: ``together(groups, rows, committed)``: the calls' runs, their rows (group_rows's JSON
#: array) and what to call once the statement has committed, before handles are made
Together = Callable[[Sequence[NewRuns], str, Callable[[], None]], list[list[InsertedRun]]]


class _Waiter:
    """One queued call: woken to lead a group, or when its group is done."""

    __slots__ = ("caller", "group", "leads", "next", "passed", "result", "row", "runs", "wake")

    def __init__(self, runs: NewRuns, caller: int) -> None:
        self.runs = runs
        self.caller = caller  # the calling thread's ident
        self.leads = False  # chosen to lead the next statement (set under the lock)
        self.row: str | None = None  # group_row(runs), made by the call while it waits
        self.wake = threading.Lock()
        self.wake.acquire()  # released by whoever wakes this call
        self.group: list[_Waiter] | None = None  # set when this call leads
        self.result: list[InsertedRun] | None = None  # None after a failed group
        self.next: _Waiter | None = None  # the follower this one wakes (see _pass_on)
        self.passed = False  # this call woke its next already


class GroupCommit:
    """Shares insert statements between concurrent callers (see the module docstring).

    ``alone(runs)`` writes one call's runs; ``together(groups, rows, committed)`` writes
    several calls' runs in one statement, returning each call's handles in order. One
    statement runs at a time (two in flight measured no faster).
    """

    def __init__(
        self,
        alone: Alone,
        together: Together,
        *,
        max_group: int = MAX_GROUP,
        hold_fraction: float | None = None,
        max_hold: float | None = None,
    ) -> None:
        self._alone = alone
        self._together = together
        self._max_group = max_group
        self._hold_fraction = HOLD_FRACTION if hold_fraction is None else hold_fraction
        self._max_hold = MAX_HOLD if max_hold is None else max_hold
        self._lock = threading.Lock()
        self._gathered = threading.Condition(self._lock)
        self._queue: list[_Waiter] = []
        self._in_flight = 0
        # the threads of the statement that committed last that have not called again, and
        # until when (time.monotonic) the next statement waits for them
        self._returning: set[int] = set()
        self._hold_until = 0.0
        # the calls of the statement that committed last, for the pace: those not back yet,
        # when it committed, until when a call coming back counts, how many did and when
        # the last of them came; the pace (seconds a call) calls came back at before
        self._awaited: set[int] = set()
        self._handed_at = 0.0
        self._counts_until = 0.0
        self._back = 0
        self._back_at = 0.0
        self._pace = 0.0
        self._gathering = False  # a leader waits in _gather

    def insert(self, runs: NewRuns) -> list[InsertedRun]:
        """Write ``runs``, sharing a statement with concurrent callers when there are any."""
        me = threading.get_ident()
        waiter, crowd = self._enter(runs, me)
        if waiter is None:
            return self._write_alone(runs, me)
        try:
            waiter.row = group_row(runs)  # a leader that takes this call first makes its own
            if not crowd:
                # every leader wakes its group in a finally, after a bounded statement
                waiter.wake.acquire()
                self._pass_on(waiter)
            group = self._gather(waiter) if waiter.leads else None
        except BaseException:  # a signal's exception in the main thread (KeyboardInterrupt)
            self._abandon(waiter)
            raise
        if group is not None:
            if len(group) == 1:  # nobody to share with: the lone caller's statement
                return self._write_alone(runs, me)
            self._lead(group)
        if waiter.result is not None:
            return waiter.result
        return self._alone(runs)  # its group failed (or ended without an answer)

    def _enter(self, runs: NewRuns, me: int) -> tuple[_Waiter | None, bool]:
        """None when the call writes alone at once, else its queue place and whether it
        leads the returning callers of the last statement (then it gathers at once)."""
        with self._lock:
            if me in self._awaited:
                self._awaited.discard(me)
                now = time.monotonic()
                if now <= self._counts_until:
                    self._back += 1
                    self._back_at = now
            returning = self._returning
            if me in returning:
                returning.discard(me)
                if self._gathering and not returning:
                    self._gathered.notify()
            if not self._in_flight and not self._queue:
                self._in_flight += 1
                if not returning or time.monotonic() >= self._hold_until:
                    return None, False
                # rather than write alone ahead of them, and split them from the next
                waiter = _Waiter(runs, me)
                waiter.leads = True
                self._queue.append(waiter)
                return waiter, True
            waiter = _Waiter(runs, me)
            self._queue.append(waiter)
            if self._gathering and len(self._queue) >= self._max_group:
                self._gathered.notify()
            return waiter, False

    def _write_alone(self, runs: NewRuns, me: int) -> list[InsertedRun]:
        """This call's statement, by itself; then the next statement may go."""
        started = time.monotonic()
        try:
            inserted = self._alone(runs)
        except BaseException:
            self._hand_over({me}, started)
            raise
        with self._lock:
            if not self._queue:
                # a lone caller: no crowd to hold for, no pace to teach
                self._in_flight -= 1
                if self._returning:  # a hold that ran out before this call came
                    self._returning = set()
                return inserted
        self._hand_over({me}, started)
        return inserted

    def _hand_over(self, callers: set[int], started: float) -> None:
        """A statement that ``callers`` made, begun at ``started``, has ended: the first
        queued call leads the next one, else one fewer statement is in flight."""
        now = time.monotonic()
        took = now - started
        hold = self._hold_fraction * took
        longest = min(HOLD_STATEMENTS * took, self._max_hold)
        with self._lock:
            self._learn_pace()
            hold = max(hold, min(COME_BACK_MARGIN * self._pace * len(callers), longest))
            self._returning = callers
            self._hold_until = now + (hold if hold < self._max_hold else self._max_hold)
            self._awaited = set(callers)
            self._handed_at, self._counts_until, self._back = now, now + longest, 0
            if not self._queue:  # _next_leader, inline
                self._in_flight -= 1
                return
            leader = self._queue[0]
            leader.leads = True
        leader.wake.release()

    def _next_leader(self) -> _Waiter | None:
        """The queued call that leads the next statement (the lock held), or None when
        nobody is queued: then one fewer statement is in flight."""
        if not self._queue:
            self._in_flight -= 1
            return None
        leader = self._queue[0]
        leader.leads = True
        return leader

    def _gather(self, leader: _Waiter) -> list[_Waiter]:
        """The group ``leader`` writes: the calls queued once the last statement's callers
        are back, the group is full, or the hold ends, whichever comes first."""
        with self._lock:
            self._gathering = True
            try:
                while self._returning and len(self._queue) < self._max_group:
                    remaining = self._hold_until - time.monotonic()
                    if remaining <= 0:
                        break
                    self._gathered.wait(remaining)
            finally:
                self._gathering = False
            self._returning = set()
            # in this order, so that an interruption between two steps leaves a state
            # _abandon handles: still queued (then no follower keeps a pointer), or cut
            group = self._queue[: self._max_group]
            for follower, after in itertools.pairwise(group[1:]):
                follower.next = after
            leader.group = group
            del self._queue[: self._max_group]
        return group

    def _learn_pace(self) -> None:
        """Fold the pace at which the last statement's callers came back into the moving
        average (the lock held); none back within the longest hold halves it, so callers
        that do not come back soon stop being waited for."""
        if self._back:
            pace = (self._back_at - self._handed_at) / self._back
            self._pace = pace if not self._pace else 0.75 * self._pace + 0.25 * pace
        elif self._handed_at:
            self._pace *= 0.5

    def _abandon(self, waiter: _Waiter) -> None:
        """An interrupted call leaves the queue (handing the lead on), or, if it formed its
        group already, passes the statement on and lets that group write alone: no call is
        left waiting for it."""
        with self._lock:
            queued = waiter in self._queue
            leader = None
            if queued:
                self._queue.remove(waiter)
                waiter.group = None
                for other in self._queue:  # none is in a group yet (see _gather)
                    other.next = None
                if waiter.leads:  # the next queued call leads, and waits for nobody
                    self._returning = set()
                    leader = self._next_leader()
        if leader is not None:
            leader.wake.release()
        if queued:
            return
        group = waiter.group
        if group is not None and group[0] is waiter:
            self._hand_over(set(), time.monotonic())
            if len(group) > 1:  # their results stay None: each writes alone
                group[1].wake.release()
        else:  # a follower: its lock is released into the void; the chain goes on from here
            self._pass_on(waiter)

    @staticmethod
    def _pass_on(waiter: _Waiter) -> None:
        """A woken follower wakes the next one (the leader wakes only the first): each wake is
        a system call under the GIL, which the next leader wants to send its statement.
        Once per call, however it ends."""
        if not waiter.passed:
            waiter.passed = True
            after = waiter.next
            if after is not None:
                after.wake.release()

    def _lead(self, group: list[_Waiter]) -> None:
        """Write the runs of ``group`` (this call's first), then wake the others."""
        handed: list[bool] = []
        started = time.monotonic()

        def committed() -> None:  # the next group may go: once, however often called
            if not handed:
                handed.append(True)
                self._hand_over({w.caller for w in group}, started)

        try:
            rows = group_rows([w.row or group_row(w.runs) for w in group])
            results = self._together([w.runs for w in group], rows, committed)
        except Exception as exc:  # each call then meets its own error, alone
            log.debug(
                "runlane: a shared trigger statement failed (%s); its %d calls write "
                "their runs alone",
                type(exc).__name__,
                len(group),
            )
        else:
            for waiter, result in zip(group, results, strict=True):
                waiter.result = result
        finally:
            committed()
            if len(group) > 1:  # who wakes the rest (_pass_on)
                group[1].wake.release()


def groupable(runs: NewRuns) -> bool:
    """Whether a call's runs may share a statement: one run of a modest size."""
    if len(runs.ids) != 1:
        return False
    key = runs.idempotency_keys[0]
    return len(runs.payloads[0]) + (0 if key is None else len(key)) <= GROUP_ROW_CHARS


def group_rows(rows: Sequence[str]) -> str:
    """The parameter of run_insert_group: the calls' rows (group_row) as one JSON array."""
    return "[" + ",".join(rows) + "]"


def group_row(runs: NewRuns) -> str:
    """One call's run as the JSON object run_insert_group reads (``json_to_recordset``);
    payload and trace context are JSON text already and go in as they are."""
    key = runs.idempotency_keys[0]
    parent = "null" if runs.parent_run_id is None else f'"{runs.parent_run_id}"'
    run_at = "null" if runs.run_at is None else json.dumps(runs.run_at.isoformat())
    shared = _shared(runs.environment, runs.task_id, runs.queue, runs.priority, runs.max_attempts)
    return (
        f'{{"id":"{runs.ids[0]}",{shared}'
        f',"k":{"null" if key is None else json.dumps(key)}'
        f',"pr":{parent},"r":{run_at},"d":{runs.delay.total_seconds()!r}'
        f',"c":{"null" if runs.trace_context is None else runs.trace_context}'
        f',"payload":{runs.payloads[0]}}}'
    )


@functools.lru_cache(maxsize=1024)
def _shared(environment: str, task_id: str, queue: str, priority: int, max_attempts: int) -> str:
    return (
        f'"e":{json.dumps(environment)},"t":{json.dumps(task_id)},"q":{json.dumps(queue)},'
        f'"p":{int(priority)},"a":{int(max_attempts)}'
    )
