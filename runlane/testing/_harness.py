"""The conformance suite's harness: what a lane provides (:class:`LaneHarness`), the runtimes
a test builds on it (:class:`LaneRuntimes`), and the waits its tests share."""

from __future__ import annotations

import abc
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest

from runlane import (
    Queue,
    RetryPolicy,
    RunContext,
    Runlane,
    Schedule,
    StopReason,
    Task,
    Worker,
    create_runlane,
)
from runlane.lanes import Lane

__all__ = ["LaneHarness", "LaneRuntimes", "runlane_threads", "wait_threads_gone"]

ONE_ATTEMPT = RetryPolicy(max_attempts=1)
HOUR = timedelta(hours=1)
LATER = RetryPolicy(max_attempts=2, initial_delay=HOUR, max_delay=HOUR, jitter=0.0)


class LaneHarness(abc.ABC):
    """What a lane supplies to the suite: how to build it, and how to start and stop the
    services it needs. One harness object serves one test."""

    #: a short name for failure messages
    name: str = "lane"

    @abc.abstractmethod
    def build_lane(self, *, lease_duration: timedelta, poll_interval: timedelta) -> Lane:
        """A new lane with these settings, on the storage :meth:`start` prepared. Every lane
        a test builds must see the same runs (a test builds several runtimes), and no
        runs may be there when the test begins."""

    def start(self) -> None:  # noqa: B027 - an optional hook
        """Before the test: make what the lane needs ready (a fresh, migrated schema; a
        broker). The default does nothing."""

    def stop(self) -> None:  # noqa: B027 - an optional hook
        """After the test, once its runtimes are closed: undo :meth:`start`. The default
        does nothing."""


class LaneRuntimes:
    """Runtimes of one test on its harness's lanes (closed after the test), and the
    questions the tests ask of the records, answered through the public API."""

    def __init__(self, harness: LaneHarness) -> None:
        self.harness = harness
        self.name = harness.name
        self.made: list[Runlane] = []
        self._observers: dict[str, Runlane] = {}

    def runtime(
        self,
        *,
        tasks: Sequence[Task[Any, Any]],
        queues: Sequence[Queue] = (),
        schedules: Sequence[Schedule] = (),
        environment: str = "default",
        lease_duration: timedelta = timedelta(seconds=30),
        poll_interval: timedelta = timedelta(seconds=1),
    ) -> Runlane:
        """A runtime on a new lane of the harness; closed after the test."""
        runtime = create_runlane(
            lane=self.harness.build_lane(
                lease_duration=lease_duration, poll_interval=poll_interval
            ),
            queues=queues,
            tasks=tasks,
            schedules=schedules,
            environment=environment,
        )
        self.made.append(runtime)
        return runtime

    def wait_ready(self, worker: Worker, timeout: float = 10.0) -> None:
        """Block until an announcement (a trigger, a cancel) would reach ``worker`` at once
        rather than at its next poll (``Acquirer.wait_ready``)."""
        if not worker.acquirer.wait_ready(timeout):
            pytest.fail(
                f"{worker.name}: the {self.name} lane's wake-up path was not ready in {timeout}s"
            )

    def close(self) -> None:
        """Close every runtime made (bounded); the first error is raised at the end."""
        errors: list[BaseException] = []
        for runtime in [*self.made, *self._observers.values()]:
            try:
                runtime.close(timeout=10)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    # -- the records, through the public API (also after the test's runtime closed) --------

    def _observer(self, environment: str) -> Runlane:
        """A runtime of its own for reading: the test's may be closed when it asks."""
        if environment not in self._observers:
            self._observers[environment] = create_runlane(
                lane=self.harness.build_lane(
                    lease_duration=timedelta(seconds=30), poll_interval=timedelta(seconds=1)
                ),
                tasks=[],
                environment=environment,
            )
        return self._observers[environment]

    def count_runs(self, status: str | None = None, *, environment: str = "default") -> int:
        """Runs of ``environment`` in ``status`` (any status when None)."""
        reader = self._observer(environment)
        count = 0
        cursor: str | None = None
        while True:
            page = reader.list_runs(status=status, limit=1000, cursor=cursor)
            count += len(page.runs)
            cursor = page.next_cursor
            if cursor is None:
                return count

    def attempt_outcomes(
        self, run_id: uuid.UUID, *, environment: str = "default"
    ) -> list[tuple[int, str, str | None]]:
        """``(attempt, outcome, error type)`` of each finished attempt of the run, in order."""
        history = self._observer(environment).get_run_history(run_id)
        return [
            (a.number, a.outcome, None if a.error is None else a.error.type)
            for a in history.attempts
        ]

    def attempts_consumed(self, run_id: uuid.UUID, *, environment: str = "default") -> int:
        """Finished attempts of the run that count against its ``max_attempts``: all but
        those handed back unconsumed (``released``)."""
        outcomes = self.attempt_outcomes(run_id, environment=environment)
        return sum(1 for _, outcome, _ in outcomes if outcome != "released")

    def describe(self, run_id: uuid.UUID, *, environment: str = "default") -> str:
        """The run and its attempts, for failure messages."""
        run = self._observer(environment).get_run(run_id)
        attempts = self.attempt_outcomes(run_id, environment=environment)
        return (
            f"run {run_id}: status={run.status.value}, attempt={run.attempt}, "
            f"error={run.error!r}; attempts {attempts}"
        )


class Calls:
    """Thread-safe record of handler executions: per run, and (run, attempt) pairs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.per_run: Counter[uuid.UUID] = Counter()
        self.attempts: list[tuple[uuid.UUID, int]] = []
        self.reasons: dict[uuid.UUID, list[StopReason | None]] = {}
        self.started: dict[uuid.UUID, threading.Event] = {}

    def enter(self, context: RunContext) -> int:
        """Record an execution; returns how many times this run's handler ran (this one too)."""
        with self._lock:
            self.per_run[context.run_id] += 1
            self.attempts.append((context.run_id, context.attempt))
            self._event(context.run_id).set()
            return self.per_run[context.run_id]

    def saw(self, context: RunContext) -> None:
        with self._lock:
            self.reasons.setdefault(context.run_id, []).append(context.stop_reason)

    def _event(self, run_id: uuid.UUID) -> threading.Event:
        return self.started.setdefault(run_id, threading.Event())

    def wait_started(self, run_id: uuid.UUID, timeout: float = 10.0) -> None:
        with self._lock:
            event = self._event(run_id)
        assert event.wait(timeout), f"the handler of run {run_id} did not start in {timeout}s"


def wait_terminal(rl: Runlane, run_ids: list[uuid.UUID], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    for run_id in run_ids:
        rl.wait_for_run(run_id, timeout=max(0.1, deadline - time.monotonic()))


def wait_until(predicate: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        pause.wait(0.02)


def together(jobs: list[Callable[[], None]], timeout: float = 30.0) -> None:
    """Run each job in its own thread, released at once by a barrier; re-raise any error."""
    barrier = threading.Barrier(len(jobs))
    errors: list[BaseException] = []

    def runner(job: Callable[[], None]) -> None:
        try:
            barrier.wait(timeout=timeout)
            job()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=runner, args=(job,), name=f"conformance-racer-{i}")
        for i, job in enumerate(jobs)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), "a job did not finish in time"
    if errors:
        raise errors[0]


def drain_until(rl: Runlane, stop: threading.Event, errors: list[BaseException]) -> None:
    """drain() again and again until ``stop`` (it returns while a bounded queue is full)."""
    try:
        while not stop.is_set():
            rl.drain(stop=stop)
            stop.wait(0.01)
    except BaseException as exc:
        errors.append(exc)


def runlane_threads(exclude: set[threading.Thread], prefix: str = "runlane-") -> list[str]:
    """Names of live threads starting with ``prefix`` that are not in ``exclude`` (those
    alive before the test)."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith(prefix) and t.is_alive() and t not in exclude
    )


def wait_threads_gone(
    exclude: set[threading.Thread], prefix: str = "runlane-", timeout: float = 5.0
) -> list[str]:
    """Wait (bounded) until no new thread starting with ``prefix`` is alive; returns the
    names of those still alive then."""
    deadline = time.monotonic() + timeout
    left = runlane_threads(exclude, prefix)
    while left and time.monotonic() < deadline:
        for thread in threading.enumerate():
            if thread.name in left and thread not in exclude:
                thread.join(max(0.0, min(0.2, deadline - time.monotonic())))
        left = runlane_threads(exclude, prefix)
    return left
