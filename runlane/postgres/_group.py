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
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from runlane.storage import InsertedRun, NewRuns

__all__ = ["MAX_GROUP", "GroupCommit", "group_params", "groupable"]

log = logging.getLogger("runlane.postgres")

#: A call joins groups when its one payload and key are at most this many characters: a
#: full group then stays within one statement's budget (``_batches.STATEMENT_BYTES``, at 4
#: bytes a character); a larger payload is written alone, as before.
GROUP_ROW_CHARS = 16 * 1024
MAX_GROUP = 256

Alone = Callable[[NewRuns], list[InsertedRun]]
Together = Callable[[Sequence[NewRuns]], list[list[InsertedRun]]]


class _Waiter:
    """One queued call: woken to lead a group, or when its group is done."""

    __slots__ = ("group", "result", "runs", "wake")

    def __init__(self, runs: NewRuns) -> None:
        self.runs = runs
        self.wake = threading.Lock()
        self.wake.acquire()  # released by whoever wakes this call
        self.group: list[_Waiter] | None = None  # set when this call leads
        self.result: list[InsertedRun] | None = None  # None after a failed group


class GroupCommit:
    """Shares insert statements between concurrent callers (see the module docstring).

    ``alone(runs)`` writes one call's runs by themselves (the path of a lone caller and of a
    failed group's calls); ``together(groups)`` writes several calls' runs in one statement
    and returns each call's handles, in order. At most ``max_in_flight`` statements run at
    once; a group takes at most ``max_group`` calls.
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
        # woken to lead a group, or by the leader of the group it is in (never left waiting:
        # every leader wakes its group in a finally, after a statement bounded by its timeout)
        try:
            waiter.wake.acquire()
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
            for other in group[1:]:
                other.wake.release()  # their result stays None: each writes alone
        # else a follower: its group's leader releases a lock nobody waits on any more

    def _lead(self, group: list[_Waiter]) -> None:
        """Write the runs of ``group`` (this call's first), then wake the others."""
        try:
            results = self._together([w.runs for w in group])
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
            self._hand_over()
            for waiter in group[1:]:
                waiter.wake.release()


def groupable(runs: NewRuns) -> bool:
    """Whether a call's runs may share a statement: one run of a modest size."""
    if len(runs.ids) != 1:
        return False
    key = runs.idempotency_keys[0]
    return len(runs.payloads[0]) + (0 if key is None else len(key)) <= GROUP_ROW_CHARS


def group_params(groups: Sequence[NewRuns]) -> dict[str, Any]:
    """The parameters of run_insert_group: one array per column, one element per run."""
    rows = [(runs, i) for runs in groups for i in range(len(runs.ids))]
    return {
        "ids": _literal(str(runs.ids[i]) for runs, i in rows),
        "environments": [runs.environment for runs, _ in rows],
        "task_ids": [runs.task_id for runs, _ in rows],
        "queues": [runs.queue for runs, _ in rows],
        "priorities": _literal(str(runs.priority) for runs, _ in rows),
        "payloads": "[" + ",".join(runs.payloads[i] for runs, i in rows) + "]",
        "max_attempts": _literal(str(runs.max_attempts) for runs, _ in rows),
        "idempotency_keys": [runs.idempotency_keys[i] for runs, i in rows],
        "parent_run_ids": _literal(_or_null(runs.parent_run_id) for runs, _ in rows),
        "run_ats": [runs.run_at for runs, _ in rows],
        "delay_seconds": _literal(repr(runs.delay.total_seconds()) for runs, _ in rows),
        "trace_contexts": [runs.trace_context for runs, _ in rows],
    }


def _literal(texts: Iterable[str]) -> str:
    """An array literal of elements whose text needs no quoting (uuids, numbers, NULL)."""
    return "{" + ",".join(texts) + "}"


def _or_null(value: uuid.UUID | None) -> str:
    return "NULL" if value is None else str(value)
