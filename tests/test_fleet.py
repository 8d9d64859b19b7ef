"""A fleet on a connection budget (issue 40): 20 worker processes, 4 producer processes and 2
maintenance replicas through one PgBouncer in transaction mode, against a PostgreSQL server
of its own with ``max_connections=40``. Every run is executed exactly once (each handler
writes its payload to its process's file: nothing lost, nothing twice), every run ends
completed with one attempt, and no process logged a warning or an error (no connection
error anywhere; PgBouncer refused no client).
The server's backends are counted while the fleet works: never more than its 40.

The issue's 20,000 runs take about 20 s here (two cores; 13 s of CPU in all, most of it the
26 interpreters starting); ``RUNLANE_FLEET_RUNS=N`` runs another size."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from runlane.postgres import apply_postgres_storage_migrations
from runlane.testing import restart_embedded_postgres, start_embedded_postgres
from tests._pgbouncer import require_pgbouncer, start_pgbouncer
from tests.helpers import finish_process, wait_until

pytestmark = pytest.mark.slow

WORKERS = 20
PRODUCERS = 4
MAINTENANCE = 2
MAX_CONNECTIONS = 40
# the pooler's server connections: the budget's rest is the test's own and the reserve
SERVER_POOL = 30
FLEET_RUNS = int(os.environ.get("RUNLANE_FLEET_RUNS", "20000"))

_SCRIPT = """
import logging, os, sys, threading
from datetime import timedelta
from runlane import create_runlane, task
from runlane.postgres import postgres_polling_lane

logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                    format="%(levelname)s %(name)s %(message)s")
role, index = sys.argv[1], int(sys.argv[2])
out = open(os.path.join(os.environ["FLEET_OUT"], f"{role}-{index}.txt"), "w")
lock = threading.Lock()

@task(id="fleet.mark")
def mark(payload, context):
    with lock:
        out.write(f"{payload}\\n")

lane = postgres_polling_lane(
    connection_string=os.environ["FLEET_URL"], schema=os.environ["FLEET_SCHEMA"],
    pooler="transaction", listen=False, poll_interval=timedelta(milliseconds=100),
    pool_max_size=2,
)
rl = create_runlane(lane=lane, tasks=[mark])
if role == "producer":
    count = int(os.environ["FLEET_PER_PRODUCER"])
    first = index * count
    singles = min(100, count)  # one at a time (group commit), the rest in batches
    threads = [
        threading.Thread(target=lambda k=k: [rl.trigger(mark, n) for n in
                         range(first + k, first + singles, 4)])
        for k in range(4)
    ]
    for thread in threads:
        thread.start()
    for start in range(first + singles, first + count, 250):
        rl.trigger_many(mark, list(range(start, min(start + 250, first + count))))
    for thread in threads:
        thread.join()
    print("ready", flush=True)
else:
    started = (rl.create_delivery_worker(concurrency=4) if role == "worker"
               else rl.start_services())
    print("ready", flush=True)
    sys.stdin.read()
    started.close(10)
rl.close(10)
out.close()
"""


@pytest.fixture(scope="module")
def budget_server() -> Iterator[str]:
    """A server of the module's own, ``max_connections=40``."""
    require_pgbouncer()
    url, server = start_embedded_postgres()
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"alter system set max_connections = {MAX_CONNECTIONS}")
            conn.execute("alter system set fsync = off")
            conn.execute("alter system set synchronous_commit = off")
        restart_embedded_postgres(server)
        yield url
    finally:
        server.cleanup()


def _start(role: str, index: int, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, role, str(index)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(f"a fleet process did not start: {line!r}\n{err}")


def test_a_fleet_through_pgbouncer_on_forty_connections(budget_server: str, tmp_path: Path) -> None:
    schema = "fleet"
    apply_postgres_storage_migrations(connection_string=budget_server, schema=schema)
    with psycopg.connect(budget_server, autocommit=True) as conn:
        assert conn.execute("show max_connections").fetchone() == (str(MAX_CONNECTIONS),)
    with start_pgbouncer(budget_server, pool_size=SERVER_POOL, max_client_conn=1000) as bouncer:
        env = {
            **os.environ,
            "FLEET_URL": bouncer.url,
            "FLEET_SCHEMA": schema,
            "FLEET_OUT": str(tmp_path),
            "FLEET_PER_PRODUCER": str(FLEET_RUNS // PRODUCERS),
        }
        consumers = [_start("worker", i, env) for i in range(WORKERS)]
        consumers += [_start("maintenance", i, env) for i in range(MAINTENANCE)]
        producers: list[subprocess.Popen[str]] = []
        try:
            for proc in consumers:
                _ready(proc)
            producers = [_start("producer", i, env) for i in range(PRODUCERS)]
            for proc in producers:
                _ready(proc)
            backends: list[int] = []
            with psycopg.connect(budget_server, autocommit=True) as conn:

                def completed() -> bool:
                    row = conn.execute(
                        "select (select count(*) from fleet.runs where status = 'completed'), "
                        "(select count(*) from pg_stat_activity where backend_type = "
                        "'client backend')"
                    ).fetchone()
                    assert row is not None
                    backends.append(int(row[1]))
                    return bool(row[0] >= FLEET_RUNS)

                wait_until(completed, timeout=240, what=f"{FLEET_RUNS} runs completed")
                statuses = {
                    str(status): int(count)
                    for status, count in conn.execute(
                        "select status, count(*) from fleet.runs group by 1"
                    ).fetchall()
                }
                twice = conn.execute(
                    "select count(*) from (select run_id from fleet.attempts group by run_id "
                    "having count(*) > 1) as again"
                ).fetchone()
        finally:
            logs = []
            for proc in consumers + producers:
                finish_process(proc)
                assert proc.stderr is not None
                assert proc.stdout is not None
                logs.append(proc.stderr.read())
                proc.stderr.close()
                proc.stdout.close()
        codes = [proc.returncode for proc in consumers + producers]
        pooler_log = bouncer.log_text()
    assert statuses == {"completed": FLEET_RUNS}
    assert twice == (0,)
    done = Counter(
        int(line)
        for path in tmp_path.glob("*.txt")
        for line in path.read_text().splitlines()
        if line
    )
    assert set(done) == set(range(FLEET_RUNS)), "a run was never executed"
    assert max(done.values()) == 1, [n for n, c in done.items() if c > 1][:10]
    bad = [line for log in logs for line in log.splitlines() if line.strip()]
    assert bad == [], bad[:20]
    assert codes == [0] * len(codes)
    refused = [line for line in pooler_log.splitlines() if "pooler error" in line]
    assert refused == [], refused[:10]
    assert max(backends) <= SERVER_POOL + 1, max(backends)  # the pooler's and this test's
