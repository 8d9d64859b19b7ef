"""Connection loss under load: a Postgres restart and killed backends while 5,000 runs execute.

Every run must complete and none may complete twice. Handlers record each execution in a
table keyed by run id (``n`` counts executions), so a run whose handler ran twice shows up.
The test owns its own server, so restarting it disturbs no other test.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from runlane import RetryPolicy, RunContext, create_runlane, task
from runlane.postgres import apply_postgres_storage_migrations, postgres_polling_lane
from runlane.testing import restart_embedded_postgres, start_embedded_postgres
from tests.helpers import poll

pytestmark = pytest.mark.slow

RUNS = 5000


@pytest.fixture(scope="module")
def own_server() -> Iterator[tuple[str, Any]]:
    if os.environ.get("RUNLANE_TEST_DATABASE_URL"):
        pytest.skip("restarting the server needs the embedded server this test starts itself")
    url, server = start_embedded_postgres()
    try:
        yield url, server
    finally:
        server.cleanup()


def _count(url: str, query: str) -> int:
    found: list[int] = []

    def answered() -> bool:
        try:
            with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
                row = conn.execute(query).fetchone()
        except psycopg.OperationalError:
            return False  # the server is restarting
        assert row is not None
        found.append(int(row[0]))
        return True

    if not poll(answered, timeout=5, interval=0.1):
        raise AssertionError("the server did not come back")
    return found[0]


def test_restart_and_terminated_backends_lose_and_repeat_nothing(
    own_server: tuple[str, Any],
) -> None:
    url, server = own_server
    schema = f"chaos_{uuid.uuid4().hex[:8]}"
    apply_postgres_storage_migrations(connection_string=url, schema=schema)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"create table {schema}.executions (run_id uuid primary key, n int not null)")

    side_effects: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
        url, min_size=2, max_size=8, kwargs={"autocommit": True}, open=True
    )

    @task(
        id="chaos.record",
        retry=RetryPolicy(
            max_attempts=50, initial_delay=timedelta(0), max_delay=timedelta(seconds=0.2)
        ),
    )
    def record(payload: dict[str, int], context: RunContext) -> int:
        with side_effects.connection() as conn:
            conn.execute(
                f"insert into {schema}.executions (run_id, n) values (%s, 1) "
                f"on conflict (run_id) do update set n = {schema}.executions.n + 1",
                (context.run_id,),
            )
        return payload["i"]

    runlane = create_runlane(
        lane=postgres_polling_lane(
            connection_string=url,
            schema=schema,
            lease_duration=timedelta(seconds=3),
            poll_interval=timedelta(milliseconds=200),
        ),
        tasks=[record],
    )
    completed_sql = f"select count(*) from {schema}.runs where status = 'completed'"
    try:
        for start in range(0, RUNS, 1000):
            runlane.trigger_many(record, [{"i": i} for i in range(start, start + 1000)])
        errors: list[BaseException] = []
        worker = runlane.create_delivery_worker(concurrency=8)
        services = runlane.start_services(
            lease_duration=timedelta(seconds=2), on_service_error=lambda e, i: errors.append(e)
        )
        restarted = terminated = False

        def step() -> bool:  # restart the server at a fifth done, kill backends at half
            nonlocal restarted, terminated
            done = _count(url, completed_sql)
            if done >= RUNS:
                return True
            if not restarted and done >= RUNS // 5:
                restart_embedded_postgres(server)
                restarted = True
            elif restarted and not terminated and done >= RUNS // 2:
                killed = _count(
                    url,
                    "select count(pg_terminate_backend(pid)) from pg_stat_activity "
                    "where application_name like 'runlane-%' and pid <> pg_backend_pid()",
                )
                assert killed > 0
                terminated = True
            return False

        poll(step, timeout=120, interval=0.05)
        worker.close(timeout=10)
        services.close(timeout=10)
        assert worker.wait_until_closed(timeout=0) is True  # closed, and not failed
        assert restarted
        assert terminated
        assert _count(url, completed_sql) == RUNS
        assert _count(url, f"select count(*) from {schema}.executions") == RUNS
        assert _count(url, f"select count(*) from {schema}.executions where n <> 1") == 0
        assert (
            _count(
                url,
                f"select count(*) from (select run_id from {schema}.attempts "
                "where outcome = 'completed' group by run_id having count(*) > 1) as twice",
            )
            == 0
        )
    finally:
        runlane.close()
        side_effects.close()
