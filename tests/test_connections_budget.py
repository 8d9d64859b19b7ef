"""Issue 40: what an idle process holds open. A process with a worker at concurrency 8 and
the maintenance services holds at most 3 backends once it has been idle a while (its LISTEN
connection and the runtime's pool); the worker's claims and writer connections come back when
work does, and a trigger still wakes the worker at once while its polls are spaced out.

The idle graces (10 s in production) and the pool's idle time are shortened here; the
figures at the real settings are printed by ``python -m benchmarks.connections``.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import runlane.maintenance._services as services_module
import runlane.postgres._acquirer as acquirer_module
import runlane.postgres._connections as connections_module
import runlane.worker._idle as idle_module
from runlane import RunContext, Worker, task
from runlane.postgres._listen_hub import shared_listeners
from tests.conftest import RunlaneFactory
from tests.helpers import poll

BUDGET = 3  # backends of an idle process with a worker and the services (issue 40)


def _backends(db: psycopg.Connection[Any], schema: str, worker: Worker) -> dict[str, int]:
    """The process's backends by application name: the runtime's pool and the worker's."""
    rows = db.execute(
        "select application_name, count(*) from pg_stat_activity"
        " where application_name = %s or application_name like %s group by 1",
        (f"runlane-{schema}", f"{worker.name}-%"),
    ).fetchall()
    return {str(name): int(n) for name, n in rows}


@pytest.fixture
def short_graces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(idle_module, "IDLE_GRACE", 0.3)
    monkeypatch.setattr(acquirer_module, "IDLE_GRACE", 0.3)
    monkeypatch.setattr(services_module, "IDLE_GRACE", 0.3)
    monkeypatch.setattr(connections_module, "_POOL_MAX_IDLE", 0.3)


@pytest.mark.usefixtures("short_graces")
def test_an_idle_process_holds_at_most_three_backends(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    ran = threading.Semaphore(0)

    @task(id="budget.noop")
    def noop(payload: Any, context: RunContext) -> None:
        ran.release()

    rl = make_runlane(tasks=[noop], lane_options={"poll_interval": timedelta(milliseconds=100)})
    rl.start()
    worker = rl.create_delivery_worker(concurrency=8)
    services = rl.start_services()
    try:
        for i in range(20):
            rl.trigger(noop, i)
        for _ in range(20):
            assert ran.acquire(timeout=10)
        busy = _backends(db, schema, worker)
        assert busy.get(f"{worker.name}-claims") == 1, busy  # claims had their own connection

        def idle() -> bool:
            held = _backends(db, schema, worker)
            return sum(held.values()) <= BUDGET and f"{worker.name}-claims" not in held

        assert poll(idle, timeout=15), _backends(db, schema, worker)
        held = _backends(db, schema, worker)
        assert held.get(f"{worker.name}-listener") == 1, held
        assert f"{worker.name}-writer" not in held, held

        # polls are spaced out now (up to ten poll intervals); NOTIFY still wakes at once,
        # and the claims connection comes back with the work
        rl.trigger(noop, "after")
        assert ran.acquire(timeout=5)
        assert not services.closed
    finally:
        services.close(timeout=10)
        worker.close(timeout=10)


def _listening(db: psycopg.Connection[Any], *workers: Worker) -> int:
    """Backends named after the workers' listeners: the shared LISTEN connection takes the
    name of its first subscriber, and another's when that one leaves."""
    row = db.execute(
        "select count(*) from pg_stat_activity where application_name = any(%s)",
        ([f"{worker.name}-listener" for worker in workers],),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_runtimes_and_workers_of_a_process_share_one_listen_connection(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    """Two runtimes and three workers on one schema: one LISTEN backend, named after its
    first subscriber; a trigger wakes a worker that joined later; it stays while any
    subscriber does and goes with the last."""
    ran = threading.Semaphore(0)

    @task(id="budget.shared")
    def shared(payload: Any, context: RunContext) -> None:
        ran.release()

    # a long poll: only a notification can start the run within the test's wait
    slow = {"poll_interval": timedelta(seconds=30)}
    first, second = (make_runlane(tasks=[shared], lane_options=slow) for _ in range(2))
    first.start()
    second.start()
    one = first.create_delivery_worker(concurrency=1)
    two = first.create_delivery_worker(concurrency=1)
    three = second.create_delivery_worker(concurrency=1)
    workers = (one, two, three)
    try:
        assert poll(lambda: _listening(db, *workers) == 1, timeout=10)
        assert shared_listeners() == 1
        one.close(timeout=10)  # the first subscriber goes; the connection stays
        assert _listening(db, *workers) == 1
        two.close(timeout=10)
        second.trigger(shared, "wake")
        assert ran.acquire(timeout=10)  # three was woken (a 30 s poll would not be in time)
        assert _listening(db, *workers) == 1
    finally:
        for worker in workers:
            worker.close(timeout=10)
    assert poll(lambda: _listening(db, *workers) == 0, timeout=10)
    assert shared_listeners() == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_a_forked_child_forgets_the_parents_listen_connection(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    """The child has none of the parent's listener threads: its first listener makes a
    connection of its own, and the parent's stays the parent's."""
    rl = make_runlane(lane_options={"poll_interval": timedelta(seconds=30)})
    rl.start()
    worker = rl.create_delivery_worker(concurrency=1)
    workers = (worker,)
    try:
        assert poll(lambda: _listening(db, *workers) == 1, timeout=10)
        assert shared_listeners() == 1
        pid = os.fork()
        if pid == 0:  # the child: report by exit status only
            os._exit(0 if shared_listeners() == 0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert shared_listeners() == 1
        assert _listening(db, *workers) == 1
    finally:
        worker.close(timeout=10)
