"""One home for an attempt's lifecycle in a worker: a claimed run is started (or handed back
when it must not start), its handler runs in a slot (``_execution.py``), and its result goes
to the lifecycle writer (or is discarded when the attempt is no longer this worker's).

The lease tracker (``_leases.py``) holds the attempt from its claim to its end; the
:class:`~runlane._attempt.AttemptControl` made here is how the worker asks its handler to
stop; telemetry sees its start and end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from runlane import _telemetry
from runlane._attempt import AttemptControl
from runlane._limits import output_limit
from runlane.context import RunContext
from runlane.errors import StopReason
from runlane.storage import ClaimedRun, LeaseRef
from runlane.tasks import Task
from runlane.worker._execution import Write, execute_attempt, make_context, timeout_failure
from runlane.worker._failure_log import log_failure
from runlane.worker._handoff import HandOff
from runlane.worker._leases import LeaseTracker
from runlane.worker._lifecycle import LifecycleWriter
from runlane.worker._middleware import Middleware
from runlane.worker._slots import Slot, SlotPool

__all__ = ["Attempts"]

log = logging.getLogger("runlane.worker")


class Attempts:
    """Runs the attempts a worker's slots take, from start to the write that records them."""

    def __init__(
        self,
        *,
        environment: str,
        tasks: Mapping[str, Task[Any, Any]],
        middleware: Sequence[Middleware],
        lease: timedelta,
        drain: bool,
        cond: threading.Condition,
        stopping: threading.Event,
        tracker: LeaseTracker,
        writer: LifecycleWriter,
        pool: SlotPool,
        handoff: HandOff,
        hand_back: Callable[[Sequence[ClaimedRun], str], None],
    ) -> None:
        self._environment = environment
        self._tasks = tasks
        self._middleware = tuple(middleware)
        self._lease = lease
        self._drain = drain
        self._cond = cond
        self._stopping = stopping
        self._tracker = tracker
        self._writer = writer
        self._pool = pool
        self._handoff = handoff
        self._hand_back = hand_back
        self.runs_executed = 0
        # drain only (one thread): attempts by outcome (see _telemetry.outcome_kind)
        self.outcomes: dict[str, int] = {}

    def _start(self, slot: Slot, claimed: ClaimedRun) -> tuple[RunContext, AttemptControl] | None:
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
                self._lease,
            )
            self._hand_back([claimed], "its lease may have lapsed before it started")
            return None
        # report_progress goes with the writer's batches
        control = AttemptControl(progress_sink=self._writer, lease_checked_at=checked_at)
        context = make_context(claimed, self._environment, slot.backend, control)
        task = self._tasks.get(claimed.task_id)
        if not self._tracker.begin(claimed, control, task):
            log.warning("run %s lost its lease while waiting for a slot; skipped", claimed.id)
            return None
        return context, control

    def run(self, slot: Slot, claimed: ClaimedRun) -> None:
        """Start ``claimed`` in ``slot``, run its handler, and record its result."""
        started_with = self._start(slot, claimed)
        if started_with is None:
            return
        context, control = started_with
        attempt = _telemetry.begin_attempt(claimed, self._lease)
        started = time.perf_counter()
        with self._cond:
            self._pool.running[claimed.ref] = (claimed, slot, started)
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
            self._handoff.handler_took(elapsed)
            with self._cond:
                self._pool.running.pop(claimed.ref, None)
            still_ours = self._tracker.untrack(claimed) is not None
        self.runs_executed += outcome.handler_ran
        if attempt is not None or self._drain:
            kind = _telemetry.outcome_kind(outcome.write, context.stop_reason)
            if not still_ours and outcome.write is not None:
                # failed at its task timeout, or handed back by close: the result is dropped
                timed_out = context.stop_reason is StopReason.TIMEOUT
                kind = _telemetry.TIMED_OUT if timed_out else _telemetry.DISCARDED
            if self._drain:
                drained = kind
                if not still_ours and context.stop_reason is StopReason.TIMEOUT:
                    # the lifecycle writer failed the attempt at its timeout: drain counts
                    # what that made of the run (retried, or failed for good)
                    task = self._tasks.get(claimed.task_id)
                    failure = timeout_failure(claimed, task).write
                    drained = _telemetry.outcome_kind(failure, context.stop_reason)
                self.outcomes[drained] = self.outcomes.get(drained, 0) + 1
            if attempt is not None:
                attempt.end(kind, outcome.write, elapsed)
        if outcome.write is None:
            return  # suspended (written on the slot's connection), timed out or lease lost
        if still_ours:
            self._submit(outcome.write)
        else:
            log.info(
                "run %s attempt %d returned after %s; its result is discarded",
                claimed.id,
                claimed.attempt,
                "its task timeout"
                if context.stop_reason is StopReason.TIMEOUT
                else "it was taken from this worker",
            )

    def _submit(self, write: Write) -> None:
        if isinstance(write, LeaseRef):
            self._writer.release(write)
        else:
            self._writer.submit(write)
