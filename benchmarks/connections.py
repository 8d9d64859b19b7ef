"""Backends and transactions of an idle process (issue 40): what a runtime, a worker and the
maintenance services hold open and do while nothing is triggered.

    python -m benchmarks.connections [--window 10] [--settle 45] [--database-url URL]

Five processes, one after the other, each its own child process on a fresh schema: a
runtime only (started, one ``status()`` call), a runtime with a polling-lane worker at
concurrency 8, one with two such workers, one with a worker and ``start_services()``, and
one with a worker that waited for a run (``wait_for_run``) before idling.
Once it says it is ready and ``--settle`` seconds have passed, the measurer counts the
child's backends in ``pg_stat_activity`` (those whose client port is one of the child's
sockets; every client backend but the measurer's when the server is reached over a Unix
socket) at the start and the end of a ``--window`` second window, and the transactions the
database counted over it
(``xact_commit + xact_rollback`` of ``pg_stat_database``), less those of a window with no
child at all (the measurer's own and the server's background). On the throw-away server
autovacuum is turned off first (it analyzes each fresh schema's tables and the catalog, a
transaction a table); on ``--database-url`` whatever else runs there is counted too.
Postgres flushes a backend's counters at most once a second (an idle one within ten), so
read the transactions a second to a tenth. The idle graces (ten seconds before polls and
maintenance passes space out, fifteen before the pool lets a connection go) are why
``--settle`` is 45 s. In the one-worker process it then triggers ``LATENCY_SAMPLES`` runs,
each ``LATENCY_IDLE`` seconds after the last (the worker idle past its grace, its polls
spaced out and its claims connection closed), and prints the median trigger-to-start: a
notification still starts the run at once. Figures are printed beside the goal of issue 40
(a process with a worker and the maintenance services: at most 3 backends idle, at most 2
transactions a second), never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import psycopg

from benchmarks._common import (
    Row,
    add_database_argument,
    fresh_schema,
    log,
    noop,
    print_table,
    runtime,
    server_url,
)
from runlane import RunContext, Runlane, task

__all__ = ["GOAL_BACKENDS", "GOAL_TRANSACTIONS", "main", "process_backends"]

GOAL_BACKENDS = 3
GOAL_TRANSACTIONS = 2.0
# runs triggered into the idle worker, each this many seconds after the last
LATENCY_SAMPLES = 5
LATENCY_IDLE = 12.0
SCENARIOS = ("runtime", "worker", "two-workers", "worker+services", "worker+wait")
_LABELS = {
    "runtime": "a runtime only",
    "worker": "runtime + polling worker, concurrency 8",
    "two-workers": "runtime + two such workers",
    "worker+services": "runtime + worker + maintenance services",
    "worker+wait": "runtime + worker, after one wait_for_run",
}


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def local_ports(pid: int) -> set[int]:
    """The local TCP ports of ``pid``'s sockets (Linux: /proc)."""
    inodes = _socket_inodes(pid)
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[9] in inodes:
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return ports


def process_backends(conn: psycopg.Connection[tuple[object, ...]], pid: int) -> int:
    """How many client backends of ``conn``'s database the process ``pid`` holds: those whose
    client port is one of its sockets; over a Unix socket (no port), every client backend
    of the database but ``conn``'s own."""
    ports = sorted(local_ports(pid))
    row = conn.execute(
        "select count(*) filter (where client_port = any(%s)),"
        " count(*) filter (where client_port = -1 or client_port is null)"
        " from pg_stat_activity where backend_type = 'client backend'"
        " and datname = current_database() and pid <> pg_backend_pid()",
        (ports,),
    ).fetchone()
    assert row is not None
    by_port, unix = int(str(row[0])), int(str(row[1]))
    return by_port if by_port or not unix else unix


def _transactions(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    conn.execute("select pg_stat_clear_snapshot()")
    row = conn.execute(
        "select xact_commit + xact_rollback from pg_stat_database"
        " where datname = current_database()"
    ).fetchone()
    assert row is not None
    return int(str(row[0]))


def _window(
    conn: psycopg.Connection[tuple[object, ...]], seconds: float, pid: int | None
) -> tuple[float, int, int]:
    """Transactions a second over ``seconds``, and ``pid``'s backends at start and end."""
    before_backends = process_backends(conn, pid) if pid is not None else 0
    start, t0 = _transactions(conn), time.monotonic()
    time.sleep(seconds)
    end, t1 = _transactions(conn), time.monotonic()
    after_backends = process_backends(conn, pid) if pid is not None else 0
    return (end - start) / (t1 - t0), before_backends, after_backends


_started: list[float] = []
_ran = threading.Event()


@task(id="bench.stamp")
def _stamp(payload: Any, context: RunContext) -> None:
    _started.append(time.perf_counter())
    _ran.set()


def _after_idle(rt: Runlane) -> list[float]:
    """Trigger-to-start (ms) of a run triggered into the idle worker, ``LATENCY_SAMPLES``
    times, each after ``LATENCY_IDLE`` seconds without work (its polls spaced out)."""
    samples = []
    for i in range(LATENCY_SAMPLES):
        if i:
            time.sleep(LATENCY_IDLE)
        _ran.clear()
        sent = time.perf_counter()
        rt.trigger(_stamp, i)
        if not _ran.wait(30):
            raise RuntimeError("a run triggered into the idle worker did not start in 30 s")
        samples.append((_started[-1] - sent) * 1000)
    return samples


def _child(scenario: str, url: str, schema: str) -> None:
    """The measured process: start ``scenario``, say ready, idle until stdin says
    ``latency`` (it then prints trigger-to-start after idle) or closes."""
    rt = runtime(url, schema, timedelta(seconds=1), tasks=[noop, _stamp])
    rt.start()
    rt.status()
    workers = []
    services = None
    if scenario != "runtime":
        workers.append(rt.create_delivery_worker(concurrency=8))
    if scenario == "two-workers":
        workers.append(rt.create_delivery_worker(concurrency=8))
    if scenario == "worker+services":
        services = rt.start_services()
    if scenario == "worker+wait":
        # wait_for_run's run ends ride the worker's LISTEN connection (one a process; before
        # issue 40 a connection of their own), their channel UNLISTENed once nobody waits
        rt.wait_for_run(rt.trigger(noop, None).id, timeout=30)
    print("ready", flush=True)
    if sys.stdin.readline().strip() == "latency":
        print(" ".join(f"{ms:.2f}" for ms in _after_idle(rt)), flush=True)
        sys.stdin.read()
    if services is not None:
        services.close(timeout=10)
    for worker in workers:
        worker.close(timeout=10)
    rt.close(timeout=10)


def _measure(
    url: str, scenario: str, window: float, settle: float
) -> tuple[int, float, list[float]]:
    schema = fresh_schema(url)
    cmd = [sys.executable, "-m", "benchmarks.connections", "--child", scenario, url, schema]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {scenario} process did not start")
        time.sleep(settle)
        with psycopg.connect(url, autocommit=True) as conn:
            rate, first, last = _window(conn, window, proc.pid)
        latencies: list[float] = []
        if scenario == "worker":
            proc.stdin.write("latency\n")
            proc.stdin.flush()
            latencies = [float(v) for v in proc.stdout.readline().split()]
        proc.stdin.close()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return max(first, last), rate, latencies


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["--child"]:
        _child(*args_list[1:4])
        return 0
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--window", type=float, default=10.0, help="seconds measured")
    parser.add_argument("--settle", type=float, default=45.0, help="seconds after ready")
    parser.add_argument("--only", default=",".join(SCENARIOS), help="scenarios, comma-separated")
    add_database_argument(parser)
    args = parser.parse_args(args_list)
    rows: list[Row] = []
    notes: list[str] = []
    with server_url(args.database_url) as url:
        with psycopg.connect(url, autocommit=True) as conn:
            if args.database_url is None:
                # the throw-away server only: autovacuum analyzes each fresh schema's tables
                # and the catalog within a minute, a transaction a table, counted as ours
                conn.execute("alter system set autovacuum = off")
                conn.execute("select pg_reload_conf()")
            baseline, _, _ = _window(conn, args.window, None)
        log(f"no child: {baseline:.2f} transactions/s (subtracted)")
        host = urlsplit(url).hostname or ""
        if not host or host.startswith("/"):
            notes.append("over a Unix socket: backends are every client backend but the measurer's")
        for scenario in args.only.split(","):
            backends, rate, latencies = _measure(url, scenario, args.window, args.settle)
            idle = max(0.0, rate - baseline)
            log(f"{scenario}: {backends} backends, {idle:.2f} transactions/s")
            goal = scenario == "worker+services"
            rows.append(
                Row(
                    f"{_LABELS[scenario]}: backends held while idle",
                    backends,
                    ",.0f",
                    target=f"<= {GOAL_BACKENDS}" if goal else "",
                    met=backends <= GOAL_BACKENDS if goal else None,
                )
            )
            rows.append(
                Row(
                    f"{_LABELS[scenario]}: transactions/s while idle",
                    idle,
                    ",.2f",
                    target=f"<= {GOAL_TRANSACTIONS:g}" if goal else "",
                    met=idle <= GOAL_TRANSACTIONS if goal else None,
                )
            )
            if latencies:
                rows.append(
                    Row(
                        f"{_LABELS[scenario]}: trigger-to-start after "
                        f"{LATENCY_IDLE:g} s idle, median of {len(latencies)} (ms)",
                        statistics.median(latencies),
                        ",.2f",
                    )
                )
                log(f"{scenario}: trigger-to-start after idle {latencies} ms")
    notes.append(
        f"transactions over {args.window:g} s after {args.settle:g} s settling, less "
        f"{baseline:.2f}/s counted with no child process"
    )
    print_table(rows, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
