"""The conformance suite's delivery tests: exactly once, promptly when idle, hand-back at
shutdown, cancel wake-up, task timeouts, bounded and paused queues, drain support."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

from runlane import (
    ConfigurationError,
    RunContext,
    RunStatus,
    StopReason,
    Worker,
    queue,
    task,
)
from runlane.testing._harness import (
    HOUR,
    LATER,
    ONE_ATTEMPT,
    Calls,
    LaneRuntimes,
    drain_until,
    together,
    wait_terminal,
    wait_until,
)

__all__ = ["DeliveryConformance"]


class DeliveryConformance:
    """Delivery, through the public API only (see :mod:`runlane.testing.conformance`)."""

    # -- delivery -------------------------------------------------------------------------

    def test_runs_triggered_before_and_after_start_execute_exactly_once(
        self, lanes: LaneRuntimes
    ) -> None:
        calls = Calls()

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
        calls = Calls()

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
        calls = Calls()

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
        calls = Calls()
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
        calls = Calls()
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
            wait_until(
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
        calls = Calls()
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
                target=drain_until,
                args=(rl, stop_drain, drain_errors),
                name="conformance-drainer",
            )
        try:
            together([start_worker, start_worker])
            if drainer is not None:
                drainer.start()
            wait_terminal(rl, [h.id for h in handles])
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

    # -- paused queues --------------------------------------------------------------------------

    def test_a_paused_queue_takes_triggers_runs_nothing_and_runs_at_once_when_resumed(
        self, lanes: LaneRuntimes
    ) -> None:
        calls = Calls()
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
        calls = Calls()

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
            wait_terminal(rl, [h.id for h in worked])

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
        calls = Calls()

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
