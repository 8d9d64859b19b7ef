"""Fixtures of the lane conformance suite: one ``lane_factory`` param per lane.

Every lane must pass ``tests/lanes/``. The tests use the public API and ``runlane.lanes``
only; what they cannot see through it (how many rows are in a status, how many attempts a
run consumed, that a worker's wake-up path is ready) each lane param provides through a
:class:`LaneHarness`. A new lane adds one param below and nothing else.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, LiteralString

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from runlane import Queue, Runlane, Schedule, Task, Worker, create_runlane
from runlane.lanes import Lane
from runlane.postgres import postgres_polling_lane
from runlane.rabbitmq import rabbitmq_lane

Conn = psycopg.Connection[Any]

# what a lane param builds a lane from: lease_duration, poll_interval
LaneBuilder = Callable[[timedelta, timedelta], Lane]


class LaneHarness:
    """One lane under test: builds runtimes on it (closed at teardown) and answers the
    questions the public API cannot (rows counted in the lane's storage, readiness)."""

    def __init__(
        self,
        *,
        name: str,
        build: LaneBuilder,
        wait_ready: Callable[[Worker, float], bool],
        db: Conn,
        schema: str,
    ) -> None:
        self.name = name
        self._build = build
        self._wait_ready = wait_ready
        self._db = db
        self._schema = schema
        self._lock = threading.Lock()
        self.made: list[Runlane] = []

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
        """A runtime on a fresh lane of this kind; closed at teardown."""
        runtime = create_runlane(
            lane=self._build(lease_duration, poll_interval),
            queues=queues,
            tasks=tasks,
            schedules=schedules,
            environment=environment,
        )
        self.made.append(runtime)
        return runtime

    def wait_ready(self, worker: Worker, timeout: float = 10.0) -> None:
        """Block until an announcement (a trigger, a cancel) would reach ``worker`` at once
        rather than at its next poll."""
        if not self._wait_ready(worker, timeout):
            pytest.fail(f"{worker.name}: the {self.name} wake-up path was not ready in {timeout}s")

    # -- rows, for assertions only ---------------------------------------------------------

    def _one(self, query: LiteralString, *params: Any) -> Any:
        with self._lock:
            text = sql.SQL(query).format(s=sql.Identifier(self._schema))
            row = self._db.execute(text, params).fetchone()
        assert row is not None
        return row[0]

    def count_runs(self, status: str | None = None, *, environment: str = "default") -> int:
        """Runs of ``environment`` stored in ``status`` (any status when None)."""
        return int(
            self._one(
                "select count(*) from {s}.runs where environment = %s "
                "and (%s::text is null or status = %s::text)",
                environment,
                status,
                status,
            )
        )

    def run_row(self, run_id: uuid.UUID) -> dict[str, Any]:
        """The stored row of the run (for failure messages)."""
        with self._lock, self._db.cursor(row_factory=dict_row) as cur:
            cur.execute(
                sql.SQL("select * from {s}.runs where id = %s").format(
                    s=sql.Identifier(self._schema)
                ),
                (run_id,),
            )
            row = cur.fetchone()
        assert row is not None, f"run {run_id} is not stored"
        return row

    def attempts_consumed(self, run_id: uuid.UUID) -> int:
        """Attempts of the run that count against its max_attempts (hand-backs do not)."""
        return int(self._one("select attempt - releases from {s}.runs where id = %s", run_id))

    def attempt_outcomes(self, run_id: uuid.UUID) -> list[tuple[int, str, str | None]]:
        """``(attempt, outcome, error type)`` of each finished attempt of the run, in order."""
        with self._lock:
            text = sql.SQL(
                "select attempt, outcome, error->>'type' from {s}.attempts "
                "where run_id = %s order by attempt"
            ).format(s=sql.Identifier(self._schema))
            rows = self._db.execute(text, (run_id,)).fetchall()
        return [(int(a), str(o), None if e is None else str(e)) for a, o, e in rows]


def _postgres_ready(worker: Worker, timeout: float) -> bool:
    """The polling lane wakes idle workers through its LISTEN connection."""
    listener = getattr(worker.acquirer, "listener", None)
    if listener is None:
        return True  # poll-only: nothing to wait for
    connected: threading.Event = listener.connected
    return connected.wait(timeout)


def _rabbitmq_ready(worker: Worker, timeout: float) -> bool:
    """The RabbitMQ lane delivers through its consumer; cancels come through LISTEN."""
    acquirer: Any = worker.acquirer
    deadline = time.monotonic() + timeout
    consuming: threading.Event = acquirer.consuming
    if not consuming.wait(timeout):
        return False
    connected: threading.Event = acquirer.listener.connected
    return connected.wait(max(0.0, deadline - time.monotonic()))


@pytest.fixture(params=["postgres-polling", "rabbitmq"])
def lane_factory(
    request: pytest.FixtureRequest, database_url: str, schema: str, db: Conn
) -> Iterator[LaneHarness]:
    """The lane under test, on this test's fresh migrated schema."""
    if request.param == "postgres-polling":

        def build(lease: timedelta, poll: timedelta) -> Lane:
            return postgres_polling_lane(
                connection_string=database_url,
                schema=schema,
                lease_duration=lease,
                poll_interval=poll,
            )

        harness = LaneHarness(
            name=request.param, build=build, wait_ready=_postgres_ready, db=db, schema=schema
        )
    elif request.param == "rabbitmq":
        amqp_url: str = request.getfixturevalue("rabbitmq_url")

        def build(lease: timedelta, poll: timedelta) -> Lane:
            return rabbitmq_lane(
                connection_string=database_url,
                schema=schema,
                amqp_url=amqp_url,
                lease_duration=lease,
                poll_interval=poll,
            )

        harness = LaneHarness(
            name=request.param, build=build, wait_ready=_rabbitmq_ready, db=db, schema=schema
        )
    else:  # pragma: no cover - a new lane adds its branch here
        raise AssertionError(f"unknown lane param {request.param!r}")
    yield harness
    for runtime in harness.made:
        runtime.close(timeout=10)


# -- shared by the suite's files -------------------------------------------------------------


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
