"""Random close timings never strand a run (a property test, on every lane).

Runs are triggered, a worker starts and is closed after a drawn delay with a drawn timeout,
while its handlers are in any phase: claimed and not started, claimed by a claim still in
flight, running and honouring the stop, running and ignoring it past the timeout. Then a
fresh worker starts (the "restart") and maintenance runs until every run is terminal.

With ``max_attempts=1`` and a short lease, a run the close stranded (claimed, never handed
back) would have its lease lapse and end ``failed`` with ``LeaseExpired``; a run whose
hand-back spent its attempt would end ``failed`` when retried. So: every run must end
``completed``, and no handler may execute twice for the same attempt.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

import attrs
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st

from runlane import RetryPolicy, RunContext, RunSnapshot, RunStatus, task
from runlane.testing.conformance import LaneRuntimes

ONE_ATTEMPT = RetryPolicy(max_attempts=1)
LEASE = timedelta(seconds=2)
# close returns within its timeout plus a small constant (the docstring says about a second)
CLOSE_SLACK = 2.0
# every run terminal after the restart within this (a stranded lease lapses after 2 s)
SETTLE_SECONDS = 15.0


@attrs.frozen
class Handler:
    seconds: float  # how long the handler works on its first execution; later ones return
    honours_stop: bool  # waits on context.cancelled and calls raise_if_stopped()


@attrs.frozen
class Plan:
    handlers: list[Handler]
    concurrency: int
    claim_batch: int
    close_after: float  # seconds between starting the worker and closing it
    close_timeout: float


timings = st.floats(min_value=0.0, max_value=0.3, allow_nan=False, allow_infinity=False)
plans = st.builds(
    Plan,
    handlers=st.lists(
        # up to past close's timeout plus its grace: a deaf handler may outlive the close
        st.builds(Handler, seconds=st.floats(0.0, 0.9), honours_stop=st.booleans()),
        min_size=1,
        max_size=20,
    ),
    concurrency=st.integers(min_value=1, max_value=4),
    claim_batch=st.integers(min_value=1, max_value=8),
    close_after=timings,
    close_timeout=st.floats(min_value=0.0, max_value=0.5, allow_nan=False),
)


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


def settle(rl: Any, run_ids: list[uuid.UUID]) -> dict[uuid.UUID, RunSnapshot]:
    """Run maintenance until every run is terminal (bounded); returns the last snapshots."""
    deadline = time.monotonic() + SETTLE_SECONDS
    pause = threading.Event()
    while True:
        snaps = {run_id: rl.get_run(run_id) for run_id in run_ids}
        if all(s.status.is_terminal for s in snaps.values()):
            return snaps
        if time.monotonic() >= deadline:
            return snaps
        rl.run_maintenance_once()  # finalizes expired leases: a stranded run would fail
        pause.wait(0.1)


def test_random_close_timings_never_strand_a_run(lane_factory: LaneRuntimes) -> None:
    executions = Executions()
    environments = itertools.count(1)

    @task(id="lanes.close-timing", retry=ONE_ATTEMPT)
    def work(payload: dict[str, Any], context: RunContext) -> int:
        executions.add(context)
        if context.attempt > 1:
            pass  # executed again after the restart: no need to wait again
        elif payload["honours_stop"]:
            context.cancelled.wait(payload["seconds"])
            context.raise_if_stopped()
        else:
            threading.Event().wait(payload["seconds"])  # busy, deaf to the stop
        n: int = payload["n"]
        return n

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
    @example(Plan([Handler(0.05, True)] * 6, 2, 8, 0.0, 0.0))
    # handlers deaf to the stop, still running when close gives up on them
    @example(Plan([Handler(0.9, False)] * 5, 3, 4, 0.05, 0.0))
    # a small timeout with handlers that honour the stop and a backlog claimed ahead
    @example(Plan([Handler(0.0, True)] * 20, 1, 8, 0.02, 0.1))
    def check(plan: Plan) -> None:
        rl = lane_factory.runtime(
            tasks=[work],
            environment=f"close-{next(environments)}",
            lease_duration=LEASE,
            poll_interval=timedelta(seconds=0.5),
        )
        try:
            handles = rl.trigger_many(
                work,
                [
                    {"n": n, "seconds": h.seconds, "honours_stop": h.honours_stop}
                    for n, h in enumerate(plan.handlers)
                ],
            )
            run_ids = [h.id for h in handles]
            worker = rl.create_delivery_worker(
                concurrency=plan.concurrency, claim_batch=plan.claim_batch
            )
            threading.Event().wait(plan.close_after)  # the drawn close timing
            asked = time.monotonic()
            worker.close(timeout=plan.close_timeout)
            took = time.monotonic() - asked
            assert took < plan.close_timeout + CLOSE_SLACK, f"close took {took:.2f}s"
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
            again = sum(1 for k in Counter(r for r, _ in pairs).values() if k > 1)
            event(f"runs executed again after the restart: {'some' if again else 'none'}")
            handed = sum(1 for s in snaps.values() if s.attempt > 1)
            event(f"runs handed back by the close: {'some' if handed else 'none'}")
        finally:
            rl.close(timeout=5)

    check()
