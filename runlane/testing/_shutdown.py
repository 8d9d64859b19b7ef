"""The conformance suite's shutdown tests: close ends every thread, a runtime owns and closes
its workers, and random close timings never strand a run (hypothesis)."""

from __future__ import annotations

import itertools
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
    Runlane,
    RunlaneClosed,
    RunSnapshot,
    RunStatus,
    StopReason,
    Task,
    queue,
    task,
)
from runlane.testing._harness import (
    ONE_ATTEMPT,
    Calls,
    LaneRuntimes,
    runlane_threads,
    wait_terminal,
    wait_threads_gone,
)

__all__ = ["ShutdownConformance"]


class ShutdownConformance:
    """Shutdown, through the public API only (see :mod:`runlane.testing.conformance`)."""

    # -- shutdown -------------------------------------------------------------------------------

    def test_close_ends_every_thread_and_is_safe_to_repeat(self, lanes: LaneRuntimes) -> None:
        before = set(threading.enumerate())

        @task(id="lanes.quick", retry=ONE_ATTEMPT)
        def quick(payload: dict[str, int], context: RunContext) -> int:
            return payload["n"]

        rl = lanes.runtime(tasks=[quick])
        worker = rl.create_delivery_worker(concurrency=3)
        handles = rl.trigger_many(quick, [{"n": i} for i in range(6)])
        wait_terminal(rl, [h.id for h in handles])
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

    # -- the runtime owns its workers -----------------------------------------------------------

    def test_a_closed_runtime_closes_its_workers_and_refuses_new_work(
        self, lanes: LaneRuntimes
    ) -> None:
        before = set(threading.enumerate())
        calls = Calls()

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
        calls = Calls()
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

        executions = Executions()
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
            close_once(lanes, work, executions, f"close-{next(environments)}", plan)

        check()


# one close-timing example: handlers (seconds, honours the stop), concurrency, claim batch,
# seconds until close, close's timeout
_ClosePlan = tuple[list[tuple[float, bool]], int, int, float, float]
_CLOSE_LEASE = timedelta(seconds=2)
_CLOSE_SLACK = 2.0  # close returns within its timeout plus a small constant
_SETTLE_SECONDS = 15.0  # every run terminal after the restart within this


class Executions:
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


def settle(rl: Runlane, run_ids: list[uuid.UUID]) -> dict[uuid.UUID, RunSnapshot]:
    """Run maintenance until every run is terminal (bounded); returns the last snapshots."""
    deadline = time.monotonic() + _SETTLE_SECONDS
    pause = threading.Event()
    while True:
        snaps = {run_id: rl.get_run(run_id) for run_id in run_ids}
        if all(s.status.is_terminal for s in snaps.values()) or time.monotonic() >= deadline:
            return snaps
        rl.run_maintenance_once()  # finalizes expired leases: a stranded run would fail
        pause.wait(0.1)


def close_once(
    lanes: LaneRuntimes,
    work: Task[Any, Any],
    executions: Executions,
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
            snaps = settle(rl, run_ids)
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
