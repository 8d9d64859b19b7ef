"""Concurrent triggering, as a threaded web app does it: T threads each trigger runs one by
one, every call returning only after its run is committed (issue 23).

    python -m benchmarks.concurrent_trigger [--triggers 8000] [--threads 1,8,32]
                                            [--database-url URL]

For each thread count, in one server and one run, each runlane figure right after its floor:

- floor: each thread its own autocommit psycopg connection, one prepared ``INSERT`` per run
  into a plain table of a run's width (``floors._table``): what a Postgres queue must do at
  least, one durable commit per call, Postgres merging the WAL flushes of concurrent commits;
- runlane: one runtime shared by the threads, ``trigger()`` without ``connection=``: its
  concurrent calls share statements and commits (group commit, ``postgres/_group.py``).

It also prints how many transactions wrote runlane's runs (distinct ``xmin`` of the rows) per
run, that is the statements and commits the calls shared, and the client's CPU time per run
(``time.process_time`` over the calls: every thread of the process, the Python cost of a
call under one GIL). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable

import psycopg
from psycopg import sql

from benchmarks._common import (
    Row,
    add_database_argument,
    fresh_schema,
    log,
    noop,
    print_table,
    ratio_row,
    runtime,
    server_url,
)
from benchmarks._statements import PerRun, counting_statements, server_cpu_seconds, wal_position
from benchmarks.floors import _payload, _table
from runlane._ids import new_run_id

__all__ = ["floor_rate", "main", "runlane_rate"]


def run_threads(threads: int, count: int, make_one: Callable[[], Callable[[int], object]]) -> float:
    """Calls/s of ``threads`` threads making ``count // threads`` calls each, all released
    at once; raises the first error a thread met."""
    per = count // threads
    ready = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def body() -> None:
        one = make_one()
        ready.wait()
        try:
            for i in range(per):
                one(i)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=body, name=f"bench-trigger-{i}") for i in range(threads)]
    for worker in workers:
        worker.start()
    ready.wait()
    started = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return per * threads / elapsed


def floor_rate(url: str, threads: int, count: int) -> float:
    """Rows/s of ``threads`` autocommit INSERT loops, a connection each."""
    with psycopg.connect(url, autocommit=True) as conn:
        table = _table(conn)
    statement = sql.SQL(
        "insert into {} (id, task_id, queue, payload) values (%s, %s, %s, %s)"
    ).format(sql.Identifier(table))
    conns: list[psycopg.Connection[tuple[object, ...]]] = []

    def make() -> Callable[[int], object]:
        conn = psycopg.connect(url, autocommit=True)
        conns.append(conn)
        return lambda i: conn.execute(
            statement, (new_run_id(), "bench.noop", "default", _payload(i)), prepare=True
        )

    try:
        return run_threads(threads, count, make)
    finally:
        for conn in conns:
            conn.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("drop table {}").format(sql.Identifier(table)))


def runlane_rate(url: str, threads: int, count: int) -> tuple[float, float, float, PerRun]:
    """Runs/s of ``threads`` threads calling ``trigger()`` on one runtime, the transactions
    per run that wrote them, the client's CPU seconds per run, and what a run cost the
    database."""
    schema = fresh_schema(url)
    with runtime(url, schema) as runlane:
        runlane.trigger(noop, {"order": -1})  # connect first, as a running app would have
        wal, server_cpu = wal_position(url), server_cpu_seconds(url)
        with counting_statements() as statements:
            cpu = time.process_time()
            rate = run_threads(
                threads, count, lambda: lambda i: runlane.trigger(noop, {"order": i})
            )
            cpu = time.process_time() - cpu
        done = count // threads * threads
        costs = PerRun.between(url, done, statements.per(done), wal, server_cpu)
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("select count(distinct xmin::text), count(*) from {}.runs").format(
                sql.Identifier(schema)
            )
        ).fetchone()
        conn.execute(sql.SQL("drop schema {} cascade").format(sql.Identifier(schema)))
    assert row is not None
    return rate, (row[0] - 1) / max(1, row[1] - 1), cpu / done, costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--triggers", type=int, default=8_000, help="calls per measure")
    parser.add_argument("--threads", default="1,8,32", help="comma-separated thread counts")
    add_database_argument(parser)
    args = parser.parse_args(argv)
    counts = [int(t) for t in args.threads.split(",") if t.strip()]
    log(
        f"concurrent triggers: {args.triggers:,} calls per measure, threads {counts}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    began = time.perf_counter()
    rows: list[Row] = []
    with server_url(args.database_url) as url:
        for threads in counts:
            floor = floor_rate(url, threads, args.triggers)
            log(f"floor: {threads} threads, autocommit INSERT each {floor:>12,.0f} rows/s")
            rate, commits, cpu, costs = runlane_rate(url, threads, args.triggers)
            log(f"runlane: {threads} threads, trigger() {rate:>12,.0f} runs/s")
            rows.append(
                ratio_row(
                    f"trigger(), {threads} thread{'s' if threads > 1 else ''} (runs/s)",
                    rate,
                    f"{threads} x autocommit INSERT loop",
                    floor,
                    None if threads == 1 else 1.0,
                )
            )
            rows.append(Row(f"  transactions per run, {threads} threads", commits, ",.3f"))
            rows.append(Row(f"  client CPU per run, {threads} threads (us)", cpu * 1e6))
            rows += costs.rows(f"{threads} threads")
    notes = [
        f"took {time.perf_counter() - began:.0f} s; load average after {os.getloadavg()[0]:.2f}"
    ]
    print_table(rows, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
