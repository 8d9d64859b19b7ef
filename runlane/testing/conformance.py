"""The lane conformance suite: what every lane must do, through the public API only.

A lane, this package's or one kept elsewhere, runs the suite from its own tests: subclass
:class:`LaneConformance` in a test module (a class whose name starts with ``Test``) and
give it a ``lane_harness`` fixture returning your :class:`LaneHarness`::

    import pytest
    from runlane.testing.conformance import LaneConformance, LaneHarness

    class MyLaneHarness(LaneHarness):
        name = "my-lane"

        def build_lane(self, *, lease_duration, poll_interval):
            return my_lane(..., lease_duration=lease_duration, poll_interval=poll_interval)

    class TestMyLane(LaneConformance):
        @pytest.fixture
        def lane_harness(self) -> MyLaneHarness:
            return MyLaneHarness()

Each test starts the harness, builds runtimes on lanes it makes, closes them and stops the
harness. The tests cover delivery (exactly once, promptly when idle), hand-back at
shutdown, cancel wake-up, task timeouts, bounded queues, paused queues, shutdown, drain
support (or its refusal), the runtime's ownership of its workers, and a property test
(hypothesis, skipped without it): random close timings never strand a run. What a test needs from
a lane beyond the public API is declared on :class:`runlane.lanes.Acquirer` (readiness);
the records a test checks are read through ``Runlane.list_runs`` and
``Runlane.get_run_history``. See docs/lanes.md. Needs pytest (the ``testing`` extra).
"""

from __future__ import annotations

import abc
import itertools
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import pytest

from runlane import (
    ConfigurationError,
    Queue,
    RetryPolicy,
    RunContext,
    Runlane,
    RunlaneClosed,
    RunSnapshot,
    RunStatus,
    Schedule,
    StopReason,
    Task,
    Worker,
    create_runlane,
    queue,
    task,
)
from runlane.lanes import Lane

__all__ = ["LaneConformance", "LaneHarness", "LaneRuntimes"]

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


class _Calls:
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


def _wait_terminal(rl: Runlane, run_ids: list[uuid.UUID], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    for run_id in run_ids:
        rl.wait_for_run(run_id, timeout=max(0.1, deadline - time.monotonic()))


def _wait_until(predicate: Callable[[], bool], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        pause.wait(0.02)


def _together(jobs: list[Callable[[], None]], timeout: float = 30.0) -> None:
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


def _drain_until(rl: Runlane, stop: threading.Event, errors: list[BaseException]) -> None:
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


class LaneConformance:
    """The suite. Subclass it as ``Test...`` with a ``lane_harness`` fixture (see the
    module docstring); every test gets a :class:`LaneRuntimes` on that harness."""

    @pytest.fixture
    def lanes(self, lane_harness: LaneHarness) -> Iterator[LaneRuntimes]:
        lane_harness.start()
        runtimes = LaneRuntimes(lane_harness)
        try:
            yield runtimes
        finally:
            try:
                runtimes.close()
            finally:
                lane_harness.stop()

    # -- delivery -------------------------------------------------------------------------

    def test_runs_triggered_before_and_after_start_execute_exactly_once(
        self, lanes: LaneRuntimes
    ) -> None:
        calls = _Calls()

        @task(id="lanes.count", retry=ONE_ATTEMPT)
        def count(payload: dict[str, int], context: RunContext) -> int:
            calls.enter(context)
            return payload["n"] * 2

        rl = lanes.runtime(tasks=[count])
        before = rl.trigger_many(count, [{"n": i} for i in range(24)])
        with rl.create_delivery_worker(concurrency=4) as worker:
            after = [rl.trigger(count, {"n": i}) for i in range(24, 48)]
            handles = before + after
            for n, handle in enumerate(handles):
                snap = rl.wait_for_run(handle.id, timeout=20)
                assert snap.status is RunStatus.COMPLETED, snap
                assert snap.output == n * 2
            assert worker.wait_until_closed(timeout=0) is False  # still running
        # counted after close: nothing ran a second time while the worker wound down
        assert calls.per_run == Counter({h.id: 1 for h in handles})
        assert lanes.count_runs("completed") == len(handles)
        assert lanes.count_runs() == len(handles)

    def test_an_idle_worker_starts_a_new_run_promptly_not_at_its_poll_interval(
        self, lanes: LaneRuntimes
    ) -> None:
        calls = _Calls()

        @task(id="lanes.mark", retry=ONE_ATTEMPT)
        def mark(payload: None, context: RunContext) -> None:
            calls.enter(context)

        rl = lanes.runtime(tasks=[mark], poll_interval=timedelta(seconds=30))
        with rl.create_delivery_worker(concurrency=1) as worker:
            assert worker.idle_signal.wait(10), "the worker never found its queue empty"
            lanes.wait_ready(worker)
            for _ in range(2):  # twice: the worker goes back to waiting and wakes again
                asked = time.monotonic()
                handle = rl.trigger(mark, None)
                calls.wait_started(handle.id, timeout=5)
                took = time.monotonic() - asked
                assert took < 2.0, f"the run started {took:.2f}s after its trigger (poll is 30 s)"
                assert rl.wait_for_run(handle.id, timeout=5).status is RunStatus.COMPLETED

    # -- hand-back at shutdown ----------------------------------------------------------------

    def test_close_hands_an_interrupted_run_back_with_its_attempt_unspent(
        self, lanes: LaneRuntimes
    ) -> None:
        calls = _Calls()

        @task(id="lanes.stoppable", retry=ONE_ATTEMPT)
        def stoppable(payload: dict[str, str], context: RunContext) -> str:
            if calls.enter(context) > 1:
                return "second time"
            context.cancelled.wait(15)
            calls.saw(context)
            if payload["then"] == "raise":
                context.raise_if_stopped()
            return "returned after the stop"

        rl = lanes.runtime(tasks=[stoppable])
        interrupted = rl.trigger(stoppable, {"then": "raise"})
        returned = rl.trigger(stoppable, {"then": "return"})
        worker = rl.create_delivery_worker(concurrency=2)
        calls.wait_started(interrupted.id)
        calls.wait_started(returned.id)
        asked = time.monotonic()
        worker.close(timeout=10)
        assert time.monotonic() - asked < 5.0, "close waited for more than its handlers"
        assert worker.wait_until_closed(timeout=0) is True

        assert calls.reasons == {
            interrupted.id: [StopReason.SHUTDOWN],
            returned.id: [StopReason.SHUTDOWN],
        }
        # raise_if_stopped on shutdown: handed back, the attempt not counted
        snap = rl.get_run(interrupted.id)
        assert snap.status is RunStatus.QUEUED, snap
        assert snap.error is None
        assert lanes.attempts_consumed(interrupted.id) == 0
        # returning normally after the stop was asked completes the run
        snap = rl.get_run(returned.id)
        assert snap.status is RunStatus.COMPLETED, snap
        assert snap.output == "returned after the stop"

        # max_attempts=1, and yet another worker gets to run it: the attempt was not spent
        with rl.create_delivery_worker(concurrency=1):
            snap = rl.wait_for_run(interrupted.id, timeout=15)
        assert snap.status is RunStatus.COMPLETED, snap
        assert snap.output == "second time"
        assert lanes.attempts_consumed(interrupted.id) == 1
        assert calls.per_run == Counter({interrupted.id: 2, returned.id: 1})

    # -- cancel wake-up -------------------------------------------------------------------------

    def test_cancel_wakes_a_running_handler_promptly(self, lanes: LaneRuntimes) -> None:
        calls = _Calls()
        seen_at: list[float] = []

        @task(id="lanes.cancellable", retry=ONE_ATTEMPT)
        def cancellable(payload: None, context: RunContext) -> str:
            calls.enter(context)
            if context.cancelled.wait(20):
                seen_at.append(time.monotonic())
            calls.saw(context)
            context.raise_if_stopped()
            return "never told"

        # a 30 s lease is extended every ~10 s: only the lane's wake-up can tell it in time
        rl = lanes.runtime(tasks=[cancellable], lease_duration=timedelta(seconds=30))
        with rl.create_delivery_worker(concurrency=1) as worker:
            lanes.wait_ready(worker)
            handle = rl.trigger(cancellable, None)
            calls.wait_started(handle.id)
            asked = time.monotonic()
            result = rl.cancel(handle.id)
            assert result.status is RunStatus.CANCELLATION_REQUESTED
            snap = rl.wait_for_run(handle.id, timeout=15)
        assert seen_at, "context.cancelled was never set"
        assert seen_at[0] - asked < 2.0, f"the handler was told after {seen_at[0] - asked:.2f}s"
        assert calls.reasons == {handle.id: [StopReason.CANCEL_REQUESTED]}
        assert snap.status is RunStatus.CANCELLED, snap
        assert snap.output is None
        assert calls.per_run == Counter({handle.id: 1})

    # -- task timeout -------------------------------------------------------------------------

    def test_a_timed_out_attempt_is_failed_with_task_timeout_and_retried_per_policy(
        self, lanes: LaneRuntimes
    ) -> None:
        calls = _Calls()
        finished = threading.Semaphore(0)

        @task(id="lanes.slow", timeout=timedelta(seconds=0.3), retry=LATER)
        def slow(payload: None, context: RunContext) -> str:
            calls.enter(context)
            try:
                context.cancelled.wait(10)
                calls.saw(context)
                context.raise_if_stopped()
                return "ignored the timeout"
            finally:
                finished.release()

        rl = lanes.runtime(tasks=[slow])
        retried = rl.trigger(slow, None)  # two attempts allowed, the next in an hour
        last = rl.trigger(slow, None, max_attempts=1)
        with rl.create_delivery_worker(concurrency=2):
            snap = rl.wait_for_run(last.id, timeout=10)
            assert snap.status is RunStatus.FAILED, snap
            _wait_until(
                lambda: rl.get_run(retried.id).status is RunStatus.RETRYING,
                timeout=10,
                what="the timed-out attempt to be failed and retried later",
            )
            for _ in range(2):
                assert finished.acquire(timeout=10), "a timed-out handler never returned"
        # the worker is closed: every write is flushed; the handlers' late raise changed nothing
        assert calls.reasons == {retried.id: [StopReason.TIMEOUT], last.id: [StopReason.TIMEOUT]}
        for handle, status in ((retried, RunStatus.RETRYING), (last, RunStatus.FAILED)):
            snap = rl.get_run(handle.id)
            assert snap.status is status, snap
            assert snap.error is not None
            assert snap.error.type == "runlane.TaskTimeout", snap.error
            assert lanes.attempts_consumed(handle.id) == 1
            outcomes = lanes.attempt_outcomes(handle.id)
            assert [(a, e) for a, _, e in outcomes] == [(1, "runlane.TaskTimeout")], outcomes
            assert outcomes[0][1] in {"failed", "retrying"}, outcomes
        assert calls.per_run == Counter({retried.id: 1, last.id: 1})

    # -- bounded queues -------------------------------------------------------------------------

    def test_a_bounded_queue_never_runs_two_handlers_at_once(self, lanes: LaneRuntimes) -> None:
        calls = _Calls()
        lock = threading.Lock()
        active = [0]
        most = [0]

        limited = queue("lanes-limited", concurrency_limit=1)

        @task(id="lanes.bounded", queue="lanes-limited", retry=ONE_ATTEMPT)
        def bounded(payload: dict[str, int], context: RunContext) -> int:
            calls.enter(context)
            with lock:
                active[0] += 1
                most[0] = max(most[0], active[0])
            try:
                threading.Event().wait(0.02)  # the handler's work: long enough to overlap
            finally:
                with lock:
                    active[0] -= 1
            return payload["n"]

        rl = lanes.runtime(tasks=[bounded], queues=[limited])
        handles = rl.trigger_many(bounded, [{"n": i} for i in range(16)])
        workers: list[Worker] = []
        stop_drain = threading.Event()

        def start_worker() -> None:
            workers.append(rl.create_delivery_worker(concurrency=3))

        drain_errors: list[BaseException] = []
        drainer = None
        if rl.lane.drain_unsupported is None:  # a drain claims beside the workers
            drainer = threading.Thread(
                target=_drain_until,
                args=(rl, stop_drain, drain_errors),
                name="conformance-drainer",
            )
        try:
            _together([start_worker, start_worker])
            if drainer is not None:
                drainer.start()
            _wait_terminal(rl, [h.id for h in handles])
        finally:
            stop_drain.set()
            if drainer is not None:
                drainer.join(10)
            for worker in workers:
                worker.close(timeout=5)
        assert drainer is None or not drainer.is_alive()
        assert drain_errors == []
        assert most[0] == 1, f"{most[0]} handlers of a queue limited to 1 ran at once"
        for n, handle in enumerate(handles):
            snap = rl.get_run(handle.id)
            assert snap.status is RunStatus.COMPLETED, snap
            assert snap.output == n
        assert calls.per_run == Counter({h.id: 1 for h in handles})

    # -- shutdown -------------------------------------------------------------------------------

    def test_close_ends_every_thread_and_is_safe_to_repeat(self, lanes: LaneRuntimes) -> None:
        before = set(threading.enumerate())

        @task(id="lanes.quick", retry=ONE_ATTEMPT)
        def quick(payload: dict[str, int], context: RunContext) -> int:
            return payload["n"]

        rl = lanes.runtime(tasks=[quick])
        worker = rl.create_delivery_worker(concurrency=3)
        handles = rl.trigger_many(quick, [{"n": i} for i in range(6)])
        _wait_terminal(rl, [h.id for h in handles])
        # the worker's threads are named after it (runlane-worker-N-...); the runtime's own
        # connection pools are named runlane-<...> too and live until the runtime closes
        mine = f"{worker.name}-"
        assert runlane_threads(before, mine), "the worker started no threads named after it"

        # a negative timeout is refused and changes nothing: the worker still executes runs
        with pytest.raises(ConfigurationError):
            worker.close(timeout=-1)
        assert not worker.closed
        extra = rl.trigger(quick, {"n": 99})
        assert rl.wait_for_run(extra.id, timeout=10).status is RunStatus.COMPLETED

        worker.close(timeout=5)
        assert wait_threads_gone(before, mine) == []
        assert worker.closed
        assert worker.wait_until_closed() is True
        assert worker.wait_until_closed(timeout=0) is True
        started = time.monotonic()
        worker.close()
        worker.close(timeout=0)
        assert time.monotonic() - started < 1.0
        with pytest.raises(ConfigurationError):
            worker.close(timeout=-1)
        assert worker.wait_until_closed(timeout=0) is True
        assert runlane_threads(before, mine) == []
        for handle in [*handles, extra]:
            assert rl.get_run(handle.id).status is RunStatus.COMPLETED
        # and once the runtime closes, no runlane- thread of this test is left at all
        rl.close(timeout=5)
        assert wait_threads_gone(before) == []

    # -- paused queues --------------------------------------------------------------------------

    def test_a_paused_queue_takes_triggers_runs_nothing_and_runs_at_once_when_resumed(
        self, lanes: LaneRuntimes
    ) -> None:
        calls = _Calls()
        started, go = threading.Event(), threading.Event()

        @task(id="lanes.queue_of", queue="held", retry=ONE_ATTEMPT)
        def queue_of(payload: str, context: RunContext) -> str:
            calls.enter(context)
            if payload == "block":
                started.set()
                assert go.wait(10)
            return context.queue

        rl = lanes.runtime(
            tasks=[queue_of],
            queues=[queue("held"), queue("open", default=True)],
            poll_interval=timedelta(seconds=30),
        )
        with rl.create_delivery_worker(concurrency=2) as worker:
            lanes.wait_ready(worker)
            running = rl.trigger(queue_of, "block")
            assert started.wait(10)
            assert rl.pause_queue("held", reason="conformance") is True
            assert rl.pause_queue("held") is False  # idempotent
            held = rl.trigger(queue_of, "x")  # accepted while paused
            go.set()  # the attempt that was running when the pause came finishes
            assert rl.wait_for_run(running.id, timeout=10).output == "held"
            # runs of other queues keep flowing; the held run is not started
            opened = rl.trigger(queue_of, "y", queue="open")
            assert rl.wait_for_run(opened.id, timeout=10).output == "open"
            assert rl.get_run(held.id).status is RunStatus.QUEUED, lanes.describe(held.id)
            info = {q.name: q for q in rl.list_queues()}["held"]
            assert info.paused
            assert info.paused_reason is None
            assert info.counts["queued"] == 1
            asked = time.monotonic()
            assert rl.resume_queue("held") is True
            assert rl.wait_for_run(held.id, timeout=10).output == "held"
            took = time.monotonic() - asked
            assert took < 3.0, f"the run started {took:.2f}s after resume (poll is 30 s)"
        assert calls.per_run[held.id] == 1

    # -- drain support --------------------------------------------------------------------------

    def test_drain_executes_due_runs_and_records_them_as_a_worker_does(
        self, lanes: LaneRuntimes
    ) -> None:
        calls = _Calls()

        @task(id="lanes.echo", retry=ONE_ATTEMPT)
        def echo(payload: dict[str, Any], context: RunContext) -> dict[str, Any]:
            calls.enter(context)
            if payload.get("fail"):
                raise ValueError(f"failing on purpose: {payload['n']}")
            return {"n": payload["n"], "seen": context.task_id}

        rl = lanes.runtime(tasks=[echo])
        if rl.lane.drain_unsupported is not None:
            pytest.skip(f"the {lanes.name} lane does not support drain()")

        payloads: list[dict[str, Any]] = [{"n": i, "fail": i % 3 == 2} for i in range(6)]
        drained = rl.trigger_many(echo, payloads)
        delayed = rl.trigger(echo, {"n": 100}, delay=HOUR)

        first = rl.drain(max_runs=2)
        assert first.runs_executed == 2
        assert sum(calls.per_run.values()) == 2
        started = time.monotonic()
        rest = rl.drain()
        assert rest.runs_executed == 4
        assert time.monotonic() - started < 10.0
        assert rl.drain().runs_executed == 0  # the delayed run does not keep it open
        assert rl.get_run(delayed.id).status is RunStatus.QUEUED
        assert calls.per_run == Counter({h.id: 1 for h in drained})

        # the same work through a worker is recorded the same way
        worked = rl.trigger_many(echo, payloads)
        with rl.create_delivery_worker(concurrency=2):
            _wait_terminal(rl, [h.id for h in worked])

        def recorded(run_id: uuid.UUID) -> tuple[Any, ...]:
            snap = rl.get_run(run_id)
            error = None if snap.error is None else (snap.error.type, snap.error.message)
            return (snap.status, snap.output, error, lanes.attempts_consumed(run_id))

        for by_drain, by_worker, payload in zip(drained, worked, payloads, strict=True):
            assert recorded(by_drain.id) == recorded(by_worker.id)
            status = RunStatus.FAILED if payload["fail"] else RunStatus.COMPLETED
            assert rl.get_run(by_drain.id).status is status
        assert recorded(drained[0].id) == (
            RunStatus.COMPLETED,
            {"n": 0, "seen": "lanes.echo"},
            None,
            1,
        )
        assert recorded(drained[2].id)[2] == ("ValueError", "failing on purpose: 2")
        assert lanes.count_runs("queued") == 1  # the delayed one, untouched throughout

    def test_drain_on_a_lane_without_drain_support_is_refused(self, lanes: LaneRuntimes) -> None:
        calls = _Calls()

        @task(id="lanes.never", retry=ONE_ATTEMPT)
        def never(payload: None, context: RunContext) -> None:
            calls.enter(context)

        rl = lanes.runtime(tasks=[never])
        if rl.lane.drain_unsupported is None:
            pytest.skip(f"the {lanes.name} lane supports drain() (the other half's test)")
        handle = rl.trigger(never, None)
        with pytest.raises(ConfigurationError, match="drain"):
            rl.drain()
        with pytest.raises(ConfigurationError, match="drain"):
            rl.drain(max_runs=1)
        assert rl.get_run(handle.id).status is RunStatus.QUEUED
        assert not calls.per_run

    # -- the runtime owns its workers -----------------------------------------------------------

    def test_a_closed_runtime_closes_its_workers_and_refuses_new_work(
        self, lanes: LaneRuntimes
    ) -> None:
        before = set(threading.enumerate())
        calls = _Calls()

        @task(id="lanes.owned", retry=ONE_ATTEMPT)
        def owned(payload: dict[str, bool], context: RunContext) -> str:
            if calls.enter(context) == 1 and payload["hold"]:
                context.cancelled.wait(15)
                calls.saw(context)
                context.raise_if_stopped()
            return "done"

        other = queue("lanes-other")
        rl = lanes.runtime(tasks=[owned], queues=[queue("default", default=True), other])
        first = rl.create_delivery_worker(concurrency=2, queues=["default"])
        # on another queue, so that it cannot pick up what the first hands back while the
        # runtime closes the workers one after the other (see the test after this one)
        second = rl.create_delivery_worker(concurrency=1, queues=["lanes-other"])
        done = rl.trigger(owned, {"hold": False})
        assert rl.wait_for_run(done.id, timeout=10).status is RunStatus.COMPLETED
        held = rl.trigger(owned, {"hold": True})
        calls.wait_started(held.id)

        rl.close(timeout=10)
        assert first.closed
        assert second.closed
        assert first.wait_until_closed(timeout=0) is True
        assert second.wait_until_closed(timeout=0) is True
        assert wait_threads_gone(before) == []
        assert calls.reasons == {held.id: [StopReason.SHUTDOWN]}

        with pytest.raises(RunlaneClosed):
            rl.create_delivery_worker(concurrency=1)
        with pytest.raises(RunlaneClosed):
            rl.trigger(owned, {"hold": False})
        with pytest.raises(RunlaneClosed):
            rl.drain()
        assert runlane_threads(before) == []  # the refused calls started nothing
        # the run in flight was handed back by the close
        assert lanes.count_runs("queued") == 1, lanes.describe(held.id)
        assert lanes.attempts_consumed(held.id) == 0
        assert lanes.count_runs() == 2  # the refused trigger wrote nothing
        assert calls.per_run == Counter({done.id: 1, held.id: 1})

    def test_a_closing_runtime_does_not_restart_what_its_workers_hand_back(
        self, lanes: LaneRuntimes
    ) -> None:
        calls = _Calls()
        slow_stop = threading.Event()

        @task(id="lanes.handed", retry=ONE_ATTEMPT)
        def handed(payload: dict[str, str], context: RunContext) -> str:
            if calls.enter(context) > 1:
                return "started again while the runtime was closing"
            context.cancelled.wait(15)
            calls.saw(context)
            if payload["kind"] == "slow":
                # notices the stop late: its worker's close waits for it meanwhile
                slow_stop.wait(1.0)
                return "slow"
            context.raise_if_stopped()  # handed back at once
            return "not stopped"

        rl = lanes.runtime(tasks=[handed])
        first = rl.create_delivery_worker(concurrency=2)
        quick = rl.trigger(handed, {"kind": "quick"})
        slow = rl.trigger(handed, {"kind": "slow"})
        calls.wait_started(quick.id)
        calls.wait_started(slow.id)
        second = rl.create_delivery_worker(concurrency=1)  # idle, on the same queue
        assert second.idle_signal.wait(10)
        lanes.wait_ready(second)

        rl.close(timeout=10)
        assert first.closed
        assert second.closed
        assert calls.per_run[quick.id] == 1, lanes.describe(quick.id)
        assert lanes.count_runs("queued") == 1
        assert lanes.attempts_consumed(quick.id) == 0

    # -- random close timings --------------------------------------------------------------

    def test_random_close_timings_never_strand_a_run(self, lanes: LaneRuntimes) -> None:
        """Runs are triggered, a worker starts and is closed after a drawn delay with a drawn
        timeout while its handlers are in any phase (claimed and not started, claimed by a
        claim still in flight, running and honouring the stop, running past the timeout and
        deaf to it); then a fresh worker starts and maintenance runs until every run is
        terminal. With ``max_attempts=1`` and a 2 s lease, a run the close stranded would end
        ``failed`` (its lease lapsed), and one whose hand-back spent its attempt would fail
        when retried: every run must end ``completed``, no attempt executing twice."""
        pytest.importorskip("hypothesis")
        # optional (the dev extra): a lane without hypothesis installed skips this test
        from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: PLC0415
        from hypothesis import strategies as st  # noqa: PLC0415

        executions = _Executions()
        environments = itertools.count(1)

        @task(id="lanes.close-timing", retry=ONE_ATTEMPT)
        def work(payload: dict[str, Any], context: RunContext) -> int:
            executions.add(context)
            if context.attempt == 1:
                if payload["honours_stop"]:
                    context.cancelled.wait(payload["seconds"])
                    context.raise_if_stopped()
                else:
                    threading.Event().wait(payload["seconds"])  # busy, deaf to the stop
            n: int = payload["n"]
            return n

        handlers = st.lists(
            # up to past close's timeout plus its grace: a deaf handler may outlive the close
            st.tuples(st.floats(0.0, 0.9), st.booleans()),
            min_size=1,
            max_size=20,
        )
        plans = st.tuples(
            handlers,
            st.integers(min_value=1, max_value=4),  # concurrency
            st.integers(min_value=1, max_value=8),  # claim batch
            st.floats(min_value=0.0, max_value=0.3),  # seconds until close
            st.floats(min_value=0.0, max_value=0.5),  # close's timeout
        )

        @settings(
            max_examples=6,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],  # no shrinking: keep the suite short
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(plan=plans)
        # close at once, while the first claim is in flight
        @example(plan=([(0.05, True)] * 6, 2, 8, 0.0, 0.0))
        # handlers deaf to the stop, still running when close gives up on them
        @example(plan=([(0.9, False)] * 5, 3, 4, 0.05, 0.0))
        # a small timeout with handlers that honour the stop and a backlog claimed ahead
        @example(plan=([(0.0, True)] * 20, 1, 8, 0.02, 0.1))
        def check(plan: _ClosePlan) -> None:
            _close_once(lanes, work, executions, f"close-{next(environments)}", plan)

        check()


# one close-timing example: handlers (seconds, honours the stop), concurrency, claim batch,
# seconds until close, close's timeout
_ClosePlan = tuple[list[tuple[float, bool]], int, int, float, float]
_CLOSE_LEASE = timedelta(seconds=2)
_CLOSE_SLACK = 2.0  # close returns within its timeout plus a small constant
_SETTLE_SECONDS = 15.0  # every run terminal after the restart within this


class _Executions:
    """(run id, attempt) of every handler execution, across examples (run ids differ)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pairs: list[tuple[uuid.UUID, int]] = []

    def add(self, context: RunContext) -> None:
        with self._lock:
            self.pairs.append((context.run_id, context.attempt))

    def of(self, run_ids: set[uuid.UUID]) -> list[tuple[uuid.UUID, int]]:
        with self._lock:
            return [pair for pair in self.pairs if pair[0] in run_ids]


def _settle(rl: Runlane, run_ids: list[uuid.UUID]) -> dict[uuid.UUID, RunSnapshot]:
    """Run maintenance until every run is terminal (bounded); returns the last snapshots."""
    deadline = time.monotonic() + _SETTLE_SECONDS
    pause = threading.Event()
    while True:
        snaps = {run_id: rl.get_run(run_id) for run_id in run_ids}
        if all(s.status.is_terminal for s in snaps.values()) or time.monotonic() >= deadline:
            return snaps
        rl.run_maintenance_once()  # finalizes expired leases: a stranded run would fail
        pause.wait(0.1)


def _close_once(
    lanes: LaneRuntimes,
    work: Task[Any, Any],
    executions: _Executions,
    environment: str,
    plan: _ClosePlan,
) -> None:
    handlers, concurrency, claim_batch, close_after, close_timeout = plan
    rl = lanes.runtime(
        tasks=[work],
        environment=environment,
        lease_duration=_CLOSE_LEASE,
        poll_interval=timedelta(seconds=0.5),
    )
    try:
        handles = rl.trigger_many(
            work,
            [
                {"n": n, "seconds": seconds, "honours_stop": honours}
                for n, (seconds, honours) in enumerate(handlers)
            ],
        )
        run_ids = [h.id for h in handles]
        worker = rl.create_delivery_worker(concurrency=concurrency, claim_batch=claim_batch)
        threading.Event().wait(close_after)  # the drawn close timing
        asked = time.monotonic()
        worker.close(timeout=close_timeout)
        took = time.monotonic() - asked
        assert took < close_timeout + _CLOSE_SLACK, f"close took {took:.2f}s"
        assert worker.wait_until_closed(timeout=0) is True  # a clean close never raises

        with rl.create_delivery_worker(concurrency=4):  # the restart
            snaps = _settle(rl, run_ids)
        wrong = {
            str(run_id): (s.status.value, s.error.type if s.error else None)
            for run_id, s in snaps.items()
            if s.status is not RunStatus.COMPLETED
        }
        assert not wrong, f"runs not completed after the restart: {wrong}"
        for n, run_id in enumerate(run_ids):
            assert snaps[run_id].output == n
            assert snaps[run_id].error is None
        pairs = executions.of(set(run_ids))
        twice = {pair: k for pair, k in Counter(pairs).items() if k > 1}
        assert not twice, f"handlers executed more than once for one attempt: {twice}"
        assert {run_id for run_id, _ in pairs} == set(run_ids)
    finally:
        rl.close(timeout=5)
