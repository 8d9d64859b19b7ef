"""Group commit for triggers: concurrent ``trigger()`` calls share statements and commits.

A call that finds no shared statement in flight and nobody queued writes its run at once,
alone, with the statement a lone trigger always used: it waits for nothing extra. A call
that arrives while a statement is in flight queues up. When that statement ends, the first
queued call leads the next one: it writes the runs of every queued call (up to
``max_group``) in one statement and one commit, while the others wait for it. No thread is
started: the callers' own threads take turns leading.

Before it cuts its group, the leader waits a short hold for the calls of the statement that
just committed to come back: threads that trigger in a loop call again at once, and
without the wait they would queue behind the next statement, so that a crowd splits into
two halves taking turns, each statement carrying half of it. For the same reason the first
of them to come back to an idle group commit gathers the others rather than writing alone
ahead of them. The hold is what the crowd was seen to need: twice the pace at which the
last crowds came back (a call at a time, under one GIL) times the calls awaited, at least
a quarter of the last statement's time, at most twice that time and ``MAX_HOLD``. A
statement written alone that nobody queued behind (a thread alone, a request now and then)
holds no one and teaches no pace: there was no crowd (_write_alone). Calls that do not
come back cost the next statement at most the hold; a hold none of them met halves the
pace, so a crowd that does not call again soon stops being waited for (_gather).

Every call returns only after the statement that holds its run has committed, with its own
handles. If a shared statement fails (one payload Postgres refuses, say) nothing of it was
written, since it is one autocommit statement; each call of that group then writes its run
again alone, on its own thread, so one bad row fails its own call and no other. Ids are made
by the client, so a group that did commit before failing (its answer lost) is found again
by the calls that retry alone.

What a call does for a group it does while it waits, off the path between two statements:
its run becomes one JSON object (``group_row``), so the leader only joins the objects of
its group into the statement's one parameter. The leader hands the statement on to the
next group as soon as its own has committed, before it sorts out its callers' handles, and
then wakes only its first follower: each follower wakes the next (_pass_on).
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

#: A call joins groups when its one payload and key are at most this many characters: a
#: full group then stays within one statement's budget (``_batches.STATEMENT_BYTES``, at 4
#: bytes a character); a larger payload is written alone, as before.
GROUP_ROW_CHARS = 16 * 1024
MAX_GROUP = 256
#: How long the next statement waits for the calls of the one that just committed to come
#: back (a thread that triggers in a loop calls again at once): COME_BACK_MARGIN times the
#: calls awaited times the pace at which calls came back before (seconds a call, a moving
#: average over gathers) but at most HOLD_STATEMENTS times the statement's own time, at
#: least HOLD_FRACTION of it, and never more than MAX_HOLD seconds (see _gather).
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

    ``alone(runs)`` writes one call's runs by themselves (the path of a lone caller and of a
    failed group's calls); ``together(groups, rows, committed)`` writes several calls' runs
    in one statement and returns each call's handles, in order. One statement runs at a
    time (two in flight measured no faster); a group takes at most ``max_group`` calls. The
    next statement waits at most ``hold_fraction`` of the last one's time (and ``max_hold``
    seconds) for the last one's calls to come back (_gather).
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
                # woken to lead a group, or by the leader of the group it is in (never left
                # waiting: every leader wakes its group in a finally, after a statement
                # bounded by its timeout)
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
        """A call arrives: None when it writes alone at once, else its place in the queue
        and whether it leads the calls of the statement that just committed, coming back
        (then nobody wakes it: it gathers them at once)."""
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
                # nobody came while it was in flight: a lone caller (a thread alone, a
                # request now and then) has no crowd to hold the next statement for nor a
                # pace to teach, so it ends with no more bookkeeping than this
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
        """The group ``leader`` writes: the calls queued when the calls of the statement
        that committed last have come back (a thread that triggers in a loop calls again at
        once), or when the group is full, or at the hold's end, whichever comes first.

        Without the wait the crowd splits in two halves that take turns: the calls of one
        statement come back while the next is in flight, and every statement carries half
        of them. The wait is a fraction of a statement's time, so a crowd that does not
        come back costs at most that."""
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
        """The next statement has ended (the lock held): the pace at which the calls of the
        one before came back (those back within the longest hold, whether or not the hold
        waited for them) goes into the moving average; when none came back within it, the
        pace halves, so that calls that do not come back soon stop being waited for."""
        if self._back:
            pace = (self._back_at - self._handed_at) / self._back
            self._pace = pace if not self._pace else 0.75 * self._pace + 0.25 * pace
        elif self._handed_at:
            self._pace *= 0.5

    def _abandon(self, waiter: _Waiter) -> None:
        """A queued call stopped waiting (its thread was interrupted): it leaves the queue
        (passing the next statement on if it was chosen to lead it), or, if it had formed
        its group already, passes the statement on and lets that group's calls write
        alone, so no call is left waiting for it."""
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
        """A follower, woken, wakes the next follower of its group: the leader wakes only
        the first. Waking a blocked thread is a system call (and on a busy machine often a
        switch to the woken thread) made while holding the GIL; passed along, the wake-ups
        of a group of 16 are not 15 in a row on the leader's thread, while the next leader
        wants the GIL to send its statement. Once per call, however it ends."""
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
    """One call's run as the JSON object run_insert_group reads (``json_to_recordset``):
    its payload and trace context are JSON text already and go in as they are, names and
    keys as JSON strings; what calls of one task usually share is made once (_shared)."""
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
