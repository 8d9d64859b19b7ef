"""Issue 40: a delayed run starts on time in an idle worker. While LISTEN is up, an idle
worker spaces its polls out (up to ten poll intervals, 10 s at most), and nothing announces
a delayed run when it comes due: its trigger announces it (schema version 27), and an empty
claim then reads when the earliest delayed run of the worker's queues comes due (in the
database's time) and the worker wakes no later. (Without the announcement, a lost one, the
worker's next spaced-out poll reads the same.)

The idle grace (10 s in production) is shortened here, so the backoff is reached in seconds.
"""

from __future__ import annotations

import queue
from datetime import timedelta
from typing import Any

import pytest

import runlane.postgres._acquirer as acquirer_module
from runlane import RunContext, task
from runlane.postgres._acquirer import PollingAcquirer
from tests.conftest import RunlaneFactory
from tests.helpers import poll

POLL = 0.5  # seconds; the backoff's cap is ten of them
SPACED = 4.0  # the polls' spacing the test waits for before the delayed trigger


@pytest.fixture
def no_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acquirer_module, "IDLE_GRACE", 0.0)


@pytest.mark.usefixtures("no_grace")
def test_an_idle_worker_starts_a_delayed_run_when_it_comes_due(
    make_runlane: RunlaneFactory,
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
        # its trigger announces it (schema version 27): the worker claims now, finds
        # nothing due, learns when the delayed run is, and does not sleep out the
        # spaced-out poll
        delayed = rl.trigger(note, "late?", delay=timedelta(seconds=2))
        assert started.get(timeout=15) == "late?"
        run = rl.get_run(delayed.id)
        assert run.started_at is not None
        late = (run.started_at - run.due_at).total_seconds()
        # before: up to the spaced-out poll (4.5-5.5 s after the claim, ~3 s late)
        assert 0 <= late < 1.5, late
    finally:
        worker.close(timeout=10)
