"""The per-minute rollup (issue 39): what it costs the processing of runs, and how fast
``Runlane.stats`` answers with a week of rollup and 1,000,000 runs stored.

    python -m benchmarks.stats [--runs 20000] [--rounds 3] [--stored 1000000]
                               [--queues 5] [--tasks 4] [--only cost,reads]
                               [--database-url URL]

``cost``: one worker process (concurrency 8) processing ``--runs`` runs, alternately on a
schema as migrated (the rollup's index on attempts, and its fold made every second by a
maintenance pass of the stats phase alone: ten times as often as the band's) and on one
without them (the index dropped, no fold); ``--rounds`` pairs, the order swapped each round.
The medians of runs/s and of WAL bytes a run are compared, and the folds' time a run is
given. ``reads``: ``--stored`` finished runs spread over a week and a week of rollup rows
(every minute, queue and task, in each span), then ``Runlane.stats`` over 1 h, 24 h and 7 d
(their default buckets), all queues and one queue and task, the median of 7 calls each; and
the first fold pass over the recent minutes with those runs stored. Figures are printed,
never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import partial

import psycopg

from benchmarks._common import (
    CONCURRENCY,
    Row,
    add_database_argument,
    fresh_schema,
    log,
    noop,
    print_table,
    runtime,
    server_url,
    timed,
    wait_drained,
)
from benchmarks._statements import PerRun, wal_position
from runlane import MaintenanceLimits, Runlane
from runlane.stats import HISTOGRAM_BOUNDS

MEASURES = ("cost", "reads")
# a maintenance pass of the stats phase alone
STATS_ONLY = MaintenanceLimits(
    schedule_limit=0,
    due_delivery_limit=0,
    wait_token_timeout_limit=0,
    wait_token_resume_limit=0,
    attempt_expiry_limit=0,
    delivery_recovery_limit=0,
    cleanup_limit=0,
)


def _process(url: str, runs: int, *, rollup: bool) -> tuple[float, PerRun, float]:
    """Runs/s of one worker process on a fresh schema, with or without the rollup, and what
    the WAL a run wrote (the folds' included)."""
    schema = fresh_schema(url)
    if not rollup:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"drop index {schema}.attempts_by_start")
    with runtime(url, schema) as runlane:
        for start in range(0, runs, 1000):
            runlane.trigger_many(noop, [None] * min(1000, runs - start))
        stop = threading.Event()
        folds: list[float] = []

        def fold() -> None:
            while not stop.wait(1.0):
                folds.append(timed(lambda: runlane.run_maintenance_once(STATS_ONLY)))

        folder = threading.Thread(target=fold, name="bench-stats-fold", daemon=True)
        wal = wal_position(url)
        started = time.perf_counter()
        if rollup:
            folder.start()
        try:
            with runlane.create_delivery_worker(concurrency=CONCURRENCY):
                wait_drained(url, schema)
                elapsed = time.perf_counter() - started
        finally:
            stop.set()
            if rollup:
                folder.join(30)
        per_run = PerRun.between(url, runs, 0.0, wal, None)
    if folds:
        log(f"  folds during processing: {len(folds)}, longest {max(folds) * 1000:.1f} ms")
    return runs / elapsed, per_run, sum(folds) / runs * 1e6


def bench_cost(url: str, runs: int, rounds: int) -> list[Row]:
    rates: dict[bool, list[float]] = {True: [], False: []}
    wal: dict[bool, list[float]] = {True: [], False: []}
    fold_us: list[float] = []
    for index in range(rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        for rollup in order:
            rate, per_run, folding = _process(url, runs, rollup=rollup)
            if rollup:
                fold_us.append(folding)
            rates[rollup].append(rate)
            wal[rollup].append(per_run.wal_bytes)
            how = "with" if rollup else "without"
            log(
                f"round {index + 1}: {how} the rollup {rate:,.0f} runs/s, "
                f"{per_run.wal_bytes:,.0f} WAL bytes a run"
            )
    rows = []
    for label, values, fmt, higher in (
        ("processing, median (runs/s)", rates, ",.0f", True),
        ("WAL a run, median (bytes)", wal, ",.0f", False),
    ):
        if not values[True] or not values[False]:
            continue
        a, b = statistics.median(values[True]), statistics.median(values[False])
        met = a >= 0.95 * b if higher else a <= 1.05 * b
        rows.append(
            Row(
                f"with the rollup: {label}",
                a,
                fmt=fmt,
                floor_label="without it",
                floor=b,
                ratio=a / b,
                target=">= 0.95x" if higher else "<= 1.05x",
                met=met,
            )
        )
    rows.append(
        Row(
            "the folds' time a run processed, median (us; a pass every second)",
            statistics.median(fold_us),
            fmt=".2f",
        )
    )
    return rows


def _fill(url: str, schema: str, stored: int, *, queues: int, tasks: int, now: datetime) -> None:
    """``stored`` finished runs over the week before ``now`` and a week of rollup rows."""
    week = 7 * 24 * 60
    buckets = len(HISTOGRAM_BOUNDS) + 1
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("set synchronous_commit = off")
        for start in range(0, stored, 100_000):
            count = min(100_000, stored - start)
            conn.execute(
                f"insert into {schema}.runs (id, environment, task_id, queue, status, payload, "
                "max_attempts, due_at, created_at, attempt, attempt_started_at, started_at, "
                "finished_at) "
                "select gen_random_uuid(), 'default', 'task_' || (i %% %(tasks)s), "
                "'queue_' || (i %% %(queues)s), 'completed', '{}', 1, t, t, 1, "
                "t + interval '20 ms', t + interval '20 ms', t + interval '70 ms' "
                "from (select i, %(now)s - (i::float8 / %(stored)s) * interval '7 days' as t "
                "from generate_series(%(first)s::int, %(last)s::int) as i) as g",
                {
                    "tasks": tasks,
                    "queues": queues,
                    "now": now,
                    "stored": stored,
                    "first": start,
                    "last": start + count - 1,
                },
            )
            log(f"stored {start + count:,} runs")
        for span in (1, 15, 60):  # every span, as the fold keeps them (random figures)
            conn.execute(
                f"insert into {schema}.stats_rollup (environment, span, minute, queue, task_id, "
                "triggered, started, completed, wait_counts, wait_sum, run_counts, run_sum) "
                "select 'default', %(span)s, m, 'queue_' || q, 'task_' || t, 10, 10, 10, "
                "array(select (random() * 5)::int from generate_series(1, %(buckets)s)), 1.5, "
                "array(select (random() * 5)::int from generate_series(1, %(buckets)s)), 2.5 "
                "from generate_series(date_bin(%(span)s * interval '1 minute', %(now)s, "
                "timestamptz 'epoch') - %(week)s * interval '1 minute', %(now)s, "
                "%(span)s * interval '1 minute') as m, "
                "generate_series(0, %(queues)s - 1) as q, generate_series(0, %(tasks)s - 1) as t",
                {
                    "span": span,
                    "buckets": buckets,
                    "now": now,
                    "week": week,
                    "queues": queues,
                    "tasks": tasks,
                },
            )
        conn.execute(f"analyze {schema}.runs")
        conn.execute(f"analyze {schema}.stats_rollup")
        row = conn.execute(f"select count(*) from {schema}.stats_rollup where span = 1").fetchone()
        log(f"a week of rollup: {row[0] if row else 0:,} rows")


def _median_ms(call: Callable[[], object], times: int = 7) -> float:
    return statistics.median(timed(call) for _ in range(times)) * 1000


def bench_reads(url: str, stored: int, queues: int, tasks: int) -> list[Row]:
    schema = fresh_schema(url)
    now = datetime.now(UTC)
    _fill(url, schema, stored, queues=queues, tasks=tasks, now=now)
    rows: list[Row] = []
    with runtime(url, schema) as runlane:
        for label, window in (
            ("1 h", timedelta(hours=1)),
            ("24 h", timedelta(days=1)),
            ("7 d", timedelta(days=7)),
        ):
            for scope, options in (
                ("all", {}),
                ("one queue and task", {"queue": "queue_1", "task": "task_1"}),
            ):
                answer = runlane.stats(since=now - window, until=now, **options)
                ms = _median_ms(partial(runlane.stats, since=now - window, until=now, **options))
                bucket = int(answer.bucket.total_seconds() // 60)
                rows.append(
                    Row(
                        f"stats {label}, {bucket} min buckets, {scope} (ms)",
                        ms,
                        fmt=".1f",
                        target="<= 200 ms",
                        met=ms <= 200,
                    )
                )
        rows.append(_fold_row(runlane))
    return rows


def _fold_row(runlane: Runlane) -> Row:
    # the first fold of the schema: six minutes of the stored runs (later passes fold only
    # the minutes closed since, and skip while none has)
    ms = timed(lambda: runlane.run_maintenance_once(STATS_ONLY)) * 1000
    return Row("the first stats pass (fold), the runs stored (ms)", ms, fmt=".1f")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=20_000, help="runs per processing measure")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of processing measures")
    parser.add_argument("--stored", type=int, default=1_000_000, help="runs stored for reads")
    parser.add_argument("--queues", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(MEASURES)}")
    add_database_argument(parser)
    args = parser.parse_args(argv)
    only = set(MEASURES if not args.only else args.only.split(","))
    rows: list[Row] = []
    with server_url(args.database_url) as url:
        if "cost" in only:
            rows += bench_cost(url, args.runs, args.rounds)
        if "reads" in only:
            rows += bench_reads(url, args.stored, args.queues, args.tasks)
    print_table(rows, compare="compared with")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
