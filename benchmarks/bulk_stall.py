"""A bulk retry beside a working worker: how long claims stall while ``retry_runs`` touches
``--runs`` failed runs (issue 19: the longest claim under 100 ms with 1,000,000).

    python -m benchmarks.bulk_stall [--runs 1000000] [--window 10] [--feed-rate 1000]
                                    [--bulk-queue bulk] [--bulk-environment default]
                                    [--database-url URL]

``--runs`` failed runs are inserted in SQL (generate_series, every index in place, then
analysed), in queue ``--bulk-queue`` of ``--bulk-environment``. A delivery worker
(concurrency 8) serves queue ``default`` of environment ``default``, fed ``--feed-rate``
runs/s by ``trigger_many`` calls every 50 ms; every ``run_claim`` call is timed. After a
``--window`` of seconds without the bulk action (the baseline), an operator runtime with no
tasks calls ``retry_runs(status="failed", queue=...)`` until it returns. The table gives
the longest claim and the claim p99 during the bulk action beside the baseline, the
trigger-to-start latency of the fed runs, the longest batch, and the bulk rate.

By default the retried runs become queued, due, in another queue of the worker's
environment, which no worker serves: a claim must not read them (it reads each served
queue's range of runs_claimable; retry_runs analyses runs once it has moved 10,000, so the
planner knows queued runs are many). ``--bulk-environment other`` keeps them out of its way
entirely, which isolates what the bulk action's batches themselves cost a claim.
"""

from __future__ import annotations

import argparse
import sys
import time

import psycopg

from benchmarks._bulk import chunks
from benchmarks._common import (
    Row,
    add_database_argument,
    fresh_schema,
    log,
    print_table,
    runtime,
    server_url,
)
from benchmarks.scale import Window, _waits, compare_row, fed, timed_claims, timed_run
from runlane import create_runlane
from runlane.postgres import postgres_polling_lane


def insert_failed(url: str, schema: str, count: int, queue: str, environment: str) -> float:
    """``count`` failed runs (attempt 3 of 3, an error stored) created over the last day,
    as a worker leaves them; returns seconds."""
    began = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        for start, end in chunks(count):
            conn.execute(
                f"""
                insert into {schema}.runs (
                    id, environment, task_id, queue, status, priority, payload, error,
                    attempt, releases, max_attempts, due_at, created_at, updated_at,
                    started_at, finished_at)
                select gen_random_uuid(), %(environment)s, 'bench.timed', %(queue)s,
                       'failed', 0, 'null'::jsonb,
                       '{{"type": "RuntimeError", "message": "upstream down"}}'::jsonb,
                       3, 0, 3, ts, ts, ts, ts, ts + interval '5 ms'
                from (select now() - interval '1 day'
                             + (g::float8 / %(total)s) * interval '23 hours' as ts
                      from generate_series(%(start)s::bigint, %(end)s::bigint - 1) as g) as s
                """,
                {
                    "environment": environment,
                    "queue": queue,
                    "total": count,
                    "start": start,
                    "end": end,
                },
            )
            log(f"failed runs: {end:,} of {count:,} ({time.perf_counter() - began:.0f} s)")
        conn.execute(f"analyze {schema}.runs")
    return time.perf_counter() - began


def measure(url: str, args: argparse.Namespace) -> list[Row]:
    schema = fresh_schema(url)
    took = insert_failed(url, schema, args.runs, args.bulk_queue, args.bulk_environment)
    log(f"{args.runs:,} failed runs inserted in {took:.0f} s")
    _waits.clear()
    operator_lane = postgres_polling_lane(connection_string=url, schema=schema)
    batches: list[tuple[float, float]] = []
    with (
        runtime(url, schema, tasks=[timed_run]) as runlane,
        create_runlane(lane=operator_lane, environment=args.bulk_environment) as operator,
        timed_claims() as claims,
    ):
        operator.retry_runs(status="failed", dry_run=True)  # connect the operator's pool first
        with fed(runlane, args.feed_rate, args.window, queues=["default"]) as (_, quiet):
            began = time.perf_counter()
            last = [began]

            def on_batch(done: int, matched: int) -> None:
                now = time.perf_counter()
                batches.append((last[0], now - last[0]))
                last[0] = now
                if len(batches) % 200 == 0:
                    log(f"bulk retry: {done:,} of {matched:,} ({now - began:.0f} s)")

            result = operator.retry_runs(status="failed", queue=args.bulk_queue, on_batch=on_batch)
            during = Window(began, time.perf_counter())
    longest = max(during.of(claims))
    quiet_longest = max(quiet.of(claims))
    log(
        f"bulk retry: {result.changed:,} of {result.matched:,} in {during.seconds:.1f} s over "
        f"{len(batches)} batches; claims: {len(quiet.of(claims))} without, "
        f"{len(during.of(claims))} during; {len(during.of(_waits)):,} fed runs started during"
    )
    where = (
        f"another queue ({args.bulk_queue})"
        if args.bulk_environment == "default"
        else f"another environment ({args.bulk_environment})"
    )
    return [
        Row(
            f"retry_runs of {args.runs:,} failed runs in {where} (runs/s; {during.seconds:.0f} s)",
            result.changed / during.seconds,
        ),
        Row("bulk retry: longest batch of 500 (ms)", max(d for _, d in batches) * 1000, ",.1f"),
        Row(
            f"longest claim during the bulk retry, {args.feed_rate:,} runs/s fed (ms)",
            longest,
            ",.1f",
            "no bulk action",
            quiet_longest,
            longest / quiet_longest,
            "< 100 ms",
            longest < 100,
        ),
        compare_row(
            "claim p99 during the bulk retry (ms)",
            during.of(claims),
            quiet.of(claims),
            0.99,
            "no bulk action",
        ),
        compare_row(
            "trigger-to-start p99 during the bulk retry (ms)",
            during.of(_waits),
            quiet.of(_waits),
            0.99,
            "no bulk action",
        ),
        compare_row(
            "trigger-to-start, longest during the bulk retry (ms)",
            during.of(_waits),
            quiet.of(_waits),
            None,
            "no bulk action",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bulk_stall", description=__doc__)
    add_database_argument(parser)
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--feed-rate", type=int, default=1000)
    parser.add_argument("--bulk-queue", default="bulk")
    parser.add_argument("--bulk-environment", default="default")
    args = parser.parse_args(argv)
    with server_url(args.database_url) as url:
        rows: list[Row] = measure(url, args)
    print_table(rows, compare="baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
