"""Issue 40: a delayed run starts on time in an idle worker. While LISTEN is up, an idle
worker spaces its polls out (up to ten poll intervals, 10 s at most), and nothing announces
a delayed run when it comes due: an empty claim then reads when the earliest delayed run of
the worker's queues comes due (in the database's time) and the worker wakes no later.

The idle grace (10 s in production) is shortened here, so the backoff is reached in seconds.
"""

from __future__ import annotations

import queue
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import runlane.postgres._acquirer as acquirer_module
from runlane import RunContext, task
from runlane.postgres._acquirer import PollingAcquirer
from runlane.postgres._sql import notify_channel
from tests.conftest import RunlaneFactory
from tests.helpers import poll

POLL = 0.5  # seconds; the backoff's cap is ten of them
SPACED = 4.0  # the polls' spacing the test waits for before the delayed trigger


@pytest.fixture
def no_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acquirer_module, "IDLE_GRACE", 0.0)


@pytest.mark.usefixtures("no_grace")
def test_an_idle_worker_starts_a_delayed_run_when_it_comes_due(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    started: queue.Queue[Any] = queue.Queue()

    @task(id="due.note")
    def note(payload: Any, context: RunContext) -> None:
        started.put(payload)

    rl = make_runlane(tasks=[note], lane_options={"poll_interval": timedelta(seconds=POLL)})
    worker = rl.create_delivery_worker(concurrency=1)
    acquirer = worker.acquirer
    assert isinstance(acquirer, PollingAcquirer)
    try:
        assert acquirer.wait_ready(10)
        # idle: polls spaced out to SPACED seconds (the next empty claim makes them 5 s)
        assert poll(lambda: acquirer.idle_poll() >= SPACED, timeout=15)
        delayed = rl.trigger(note, "late?", delay=timedelta(seconds=2))
        # a notification on its queue (another process's trigger of a due run, taken by
        # another worker) has the worker claim now: nothing is due; it learns when the
        # delayed run is, and does not sleep out the spaced-out poll
        db.execute("select pg_notify(%s, %s)", (notify_channel(schema), "default|default"))
        assert started.get(timeout=15) == "late?"
        run = rl.get_run(delayed.id)
        assert run.started_at is not None
        late = (run.started_at - run.due_at).total_seconds()
        # before: up to the spaced-out poll (4.5-5.5 s after the claim, ~3 s late)
        assert 0 <= late < 1.5, late
    finally:
        worker.close(timeout=10)


@pytest.mark.usefixtures("no_grace")
def test_an_idle_worker_learns_a_delayed_run_at_its_own_poll(
    make_runlane: RunlaneFactory,
) -> None:
    """No notification at all: the worker's next spaced-out poll finds the run not yet due
    and wakes when it is, not a whole poll spacing later."""
    started: queue.Queue[Any] = queue.Queue()

    @task(id="due.quiet")
    def quiet(payload: Any, context: RunContext) -> None:
        started.put(payload)

    rl = make_runlane(tasks=[quiet], lane_options={"poll_interval": timedelta(seconds=POLL)})
    worker = rl.create_delivery_worker(concurrency=1)
    acquirer = worker.acquirer
    assert isinstance(acquirer, PollingAcquirer)
    try:
        assert acquirer.wait_ready(10)
        assert poll(lambda: acquirer.idle_poll() >= SPACED, timeout=15)
        # the claim that spaced polls out to 4 s has just been made: the next comes 3.6-4.4 s
        # later, finds this run not yet due, and the one after that would be 4.5-5.5 s later
        # still (before: ~4 s late)
        delayed = rl.trigger(quiet, "quiet", delay=timedelta(seconds=4.5))
        assert started.get(timeout=15) == "quiet"
        run = rl.get_run(delayed.id)
        assert run.started_at is not None
        late = (run.started_at - run.due_at).total_seconds()
        assert 0 <= late < 1.5, late
    finally:
        worker.close(timeout=10)
