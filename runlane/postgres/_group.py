"""Group commit for triggers: concurrent ``trigger()`` calls share statements and commits.

A call that finds no shared statement in flight and nobody queued writes its run at once,
alone, with the statement a lone trigger always used: it waits for nothing extra. A call
that arrives while a statement is in flight queues up. When that statement ends, the first
queued call leads the next one: it writes the runs of every queued call (up to
``max_group``) in one statement and one commit, while the others wait for it. No thread is
started: the callers' own threads take turns leading.

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
from collections.abc import Callable, Sequence

from runlane.storage import InsertedRun, NewRuns

__all__ = ["MAX_GROUP", "GroupCommit", "group_row", "group_rows", "groupable"]

log = logging.getLogger("runlane.postgres")

#: A call joins groups when its one payload and key are at most this many characters: a
#: full group then stays within one statement's budget (``_batches.STATEMENT_BYTES``, at 4
#: bytes a character); a larger payload is written alone, as before.
GROUP_ROW_CHARS = 16 * 1024
MAX_GROUP = 256

Alone = Callable[[NewRuns], list[InsertedRun]]
#: ``together(groups, rows, committed)``: the calls' runs, their rows (group_rows's JSON
#: array) and what to call once the statement has committed, before handles are made
Together = Callable[[Sequence[NewRuns], str, Callable[[], None]], list[list[InsertedRun]]]


class _Waiter:
    """One queued call: woken to lead a group, or when its group is done."""

    __slots__ = ("group", "next", "passed", "result", "row", "runs", "wake")

    def __init__(self, runs: NewRuns) -> None:
        self.runs = runs
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
    in one statement and returns each call's handles, in order. At most ``max_in_flight``
    statements run at once; a group takes at most ``max_group`` calls.
    """

    def __init__(
        self,
        alone: Alone,
        together: Together,
        *,
        max_group: int = MAX_GROUP,
        max_in_flight: int = 1,
    ) -> None:
        self._alone = alone
        self._together = together
        self._max_group = max_group
        self._max_in_flight = max_in_flight
        self._lock = threading.Lock()
        self._queue: list[_Waiter] = []
        self._in_flight = 0

    def insert(self, runs: NewRuns) -> list[InsertedRun]:
        """Write ``runs``, sharing a statement with concurrent callers when there are any."""
        with self._lock:
            if self._in_flight < self._max_in_flight and not self._queue:
                self._in_flight += 1
                waiter = None
            else:
                waiter = _Waiter(runs)
                self._queue.append(waiter)
        if waiter is None:
            try:
                return self._alone(runs)
            finally:
                self._hand_over()
        try:
            waiter.row = group_row(runs)  # a leader that takes this call first makes its own
            # woken to lead a group, or by the leader of the group it is in (never left
            # waiting: every leader wakes its group in a finally, after a statement bounded
            # by its timeout)
            waiter.wake.acquire()
            self._pass_on(waiter)
        except BaseException:  # a signal's exception in the main thread (KeyboardInterrupt)
            self._abandon(waiter)
            raise
        if waiter.group is not None:
            if len(waiter.group) == 1:  # nobody to share with: the lone caller's statement
                try:
                    return self._alone(runs)
                finally:
                    self._hand_over()
            self._lead(waiter.group)
        if waiter.result is not None:
            return waiter.result
        return self._alone(runs)  # its group failed (or ended without an answer)

    def _hand_over(self) -> None:
        """A statement ended: the first queued call leads the next group, else one fewer
        statement is in flight."""
        with self._lock:
            if not self._queue:
                self._in_flight -= 1
                return
            group = self._queue[: self._max_group]
            del self._queue[: self._max_group]
            for follower, after in itertools.pairwise(group[1:]):
                follower.next = after
        leader = group[0]
        leader.group = group
        leader.wake.release()

    def _abandon(self, waiter: _Waiter) -> None:
        """A queued call stopped waiting (its thread was interrupted): it leaves the queue,
        or, if it was already chosen to lead a group, passes the statement on and lets that
        group's calls write alone, so no call is left waiting for it."""
        with self._lock:
            if waiter in self._queue:
                self._queue.remove(waiter)
                return
        group = waiter.group
        if group is not None and group[0] is waiter:
            self._hand_over()
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

        def committed() -> None:  # the next group may go: once, however often called
            if not handed:
                handed.append(True)
                self._hand_over()

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
