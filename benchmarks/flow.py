"""Flow control (issue 20): rate limits and per-key concurrency, measured.

    python -m benchmarks.flow [--only keyed,hol,waiting,rate] [--keys 10000]
                              [--per-key 10] [--hot 100000] [--waiting 100000]
                              [--window 60] [--rate 200] [--database-url URL]

``keyed``: one worker process (concurrency 8) processes ``--keys`` x ``--per-key`` runs of
a queue with ``key_concurrency_limit=1``, right after the same number of runs of a queue
without limits (issue 20: >= 0.5x the unkeyed rate). ``hol``: ``--hot`` runs of one key,
queued first, and 1,000 runs over 100 other keys; how long until every one of the 1,000
has started (issue 20: within seconds). ``waiting``: ``--waiting`` runs held back, behind a
key whose one run is running, and behind a rate limit that has spent its window, while a
worker (concurrency 8) serves the queue: the server's transactions and the tuples written
and left dead, per second and per minute, over ``--window`` seconds (issue 20: flat and
small). ``rate``: three worker processes share a queue with ``RateLimit(--rate, 1 s)``
(and one with ``burst=10``): the achieved rate over the middle windows and the most starts
in any window of a second (issue 20: within 5% of the limit, never above).

Runs are inserted in SQL (generate_series, as ``trigger_many`` would store them, every
index in place, then analysed), so set-up time stays out of the figures. Figures are
printed, never asserted.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from datetime import datetime, timedelta
from typing import Any

import psycopg

from benchmarks._bulk import chunks
from benchmarks._common import (
    CONCURRENCY,
    Row,
    add_database_argument,
    fresh_schema,
    log,
    noop,
    print_table,
    ratio_row,
    runtime,
    server_url,
    wait_drained,
)
from runlane import RateLimit, RunContext, Runlane, queue, task

MEASURES = ("keyed", "hol", "waiting", "rate")


@task(id="bench.hold")
def hold(payload: Any, context: RunContext) -> None:
    """Hold a slot (and its key) until the attempt is asked to stop."""
    context.cancelled.wait(float(payload or 600))


def flow_runtime(url: str, schema: str, **limits: Any) -> Runlane:
    """A runtime whose queue ``q`` has ``limits`` (queue() keywords)."""
    return runtime(url, schema, tasks=[noop, hold], queues=[queue("q", default=True, **limits)])


def insert_queued(url: str, schema: str, count: int, keys: int | None, key: str | None) -> None:
    """``count`` queued runs of bench.noop in queue ``q``, due now, in insertion order: with
    ``keys`` spread over that many keys (k0, k1, ...), else all with ``key``."""
    with psycopg.connect(url, autocommit=True) as conn:
        for start, end in chunks(count):
            conn.execute(
                f"""
                insert into {schema}.runs (id, environment, task_id, queue, status, payload,
                                           max_attempts, due_at, concurrency_key)
                select gen_random_uuid(), 'default', 'bench.noop', 'q', 'queued', 'null',
                       1, now() - interval '1 hour' + g * interval '1 microsecond',
                       case when %(keys)s::int is null then %(key)s::text
                            else 'k' || (g %% %(keys)s::int) end
                from generate_series(%(start)s::bigint, %(end)s::bigint - 1) as g
                """,
                {"keys": keys, "key": key, "start": start, "end": end},
            )
        conn.execute(f"vacuum analyze {schema}.runs")


def processing(url: str, runs: int, keys: int | None) -> float:
    """runs/s of one worker (concurrency 8) over ``runs`` queued runs of queue ``q``: keyed
    (``keys`` keys, limit 1 each) or not."""
    schema = fresh_schema(url)
    limits = {} if keys is None else {"key_concurrency_limit": 1}
    insert_queued(url, schema, runs, keys, None)
    with flow_runtime(url, schema, **limits) as runlane:
        runlane.start()
        started = time.perf_counter()
        with runlane.create_delivery_worker(concurrency=CONCURRENCY):
            wait_drained(url, schema)
            elapsed = time.perf_counter() - started
    return runs / elapsed


def bench_keyed(url: str, args: argparse.Namespace) -> list[Row]:
    runs = args.keys * args.per_key
    rows = []
    for attempt in (1, 2):
        plain = processing(url, runs, None)
        log(f"unkeyed: {plain:,.0f} runs/s ({runs:,} runs), try {attempt}")
        keyed = processing(url, runs, args.keys)
        log(f"keyed, {args.keys:,} keys x {args.per_key}, limit 1: {keyed:,.0f} runs/s")
        rows.append(
            ratio_row(
                f"processing, {args.keys:,} keys x {args.per_key}, limit 1 (runs/s)",
                keyed,
                "same runs, no key",
                plain,
                0.5,
            )
        )
    return rows


def bench_hol(url: str, args: argparse.Namespace) -> list[Row]:
    """Seconds from the worker's start until all 1,000 runs of the other keys started."""
    schema = fresh_schema(url)
    insert_queued(url, schema, args.hot, None, "hot")
    with flow_runtime(url, schema, key_concurrency_limit=1) as runlane:
        handles = []
        for i in range(100):
            handles += runlane.trigger_many(noop, [None] * 10, concurrency_key=f"other{i}")
        with psycopg.connect(url, autocommit=True) as conn:
            (began,) = conn.execute("select clock_timestamp()").fetchone() or (None,)
            with runlane.create_delivery_worker(concurrency=CONCURRENCY):
                for handle in handles:
                    runlane.wait_for_run(handle.id, timeout=120)
            (last, hot) = conn.execute(
                f"select (select max(started_at) from {schema}.runs "
                "where concurrency_key like 'other%%'), "
                f"(select count(*) from {schema}.runs where concurrency_key = 'hot' "
                "and status = 'completed')"
            ).fetchone() or (None, None)
    assert isinstance(began, datetime)
    assert isinstance(last, datetime)
    seconds = (last - began).total_seconds()
    log(f"hol: the 1,000 other runs all started {seconds:.2f} s after the worker; hot ran {hot}")
    return [
        Row(
            f"1,000 runs of 100 keys behind {args.hot:,} of one key: all started after (s)",
            seconds,
            ",.2f",
            target="within seconds",
        ),
        Row("  runs of the hot key completed meanwhile (one at a time)", float(hot or 0)),
    ]


_STATS = """
select (select xact_commit + xact_rollback from pg_stat_database
        where datname = current_database()),
       coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0),
       coalesce(sum(n_dead_tup), 0)
from pg_stat_user_tables where schemaname = %s
"""


def _stats(conn: psycopg.Connection[Any], schema: str) -> tuple[int, int, int]:
    conn.execute("select pg_stat_clear_snapshot()")
    row = conn.execute(_STATS, (schema,)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def waiting(url: str, args: argparse.Namespace, label: str, **limits: Any) -> list[Row]:
    """Transactions, tuples written and dead tuples while ``--waiting`` runs wait."""
    schema = fresh_schema(url)
    with flow_runtime(url, schema, **limits) as runlane:
        key = "hot" if "key_concurrency_limit" in limits else None
        first = runlane.trigger(hold, 600, concurrency_key=key)
        with runlane.create_delivery_worker(concurrency=CONCURRENCY):
            deadline = time.monotonic() + 30
            while runlane.get_run(first.id).status.value != "running":
                if time.monotonic() > deadline:
                    raise TimeoutError("the holding run did not start")
                time.sleep(0.05)
            insert_queued(url, schema, args.waiting, None, key)
            time.sleep(5)  # settle: autovacuum of the insert, the workers' first claims
            with psycopg.connect(url, autocommit=True) as conn:
                before = _stats(conn, schema)
                began = time.perf_counter()
                time.sleep(args.window)
                time.sleep(1.5)  # backends flush their statistics at most once a second
                after = _stats(conn, schema)
                elapsed = time.perf_counter() - began - 1.5
                (queued,) = conn.execute(
                    f"select count(*) from {schema}.runs where status = 'queued'"
                ).fetchone() or (0,)
            runlane.cancel(first.id)
    xacts = (after[0] - before[0] - 4) / elapsed  # less this connection's own reads
    written = (after[1] - before[1]) / elapsed
    dead = (after[2] - before[2]) / elapsed * 60
    log(
        f"waiting ({label}): {queued:,} queued; {xacts:.1f} transactions/s, {written:.2f} "
        f"tuples written/s, dead tuples {dead:+.1f}/min over {elapsed:.0f} s"
    )
    return [
        Row(f"{args.waiting:,} runs held back {label}: transactions/s", xacts, ",.1f"),
        Row("  tuples inserted+updated+deleted/s, runlane tables", written, ",.2f"),
        Row("  dead tuples added/min, runlane tables", dead, ",.1f"),
    ]


def bench_waiting(url: str, args: argparse.Namespace) -> list[Row]:
    return [
        *waiting(url, args, "by key_concurrency_limit=1", key_concurrency_limit=1),
        *waiting(url, args, "by RateLimit(1, 1 day)", rate_limit=RateLimit(1, 86_400)),
    ]


def _rate_worker(url: str, schema: str, rate: RateLimit, events: tuple[Any, Any, Any]) -> None:
    ready, go, stop = events
    runlane = flow_runtime(url, schema, rate_limit=rate)
    runlane.start()
    ready.set()
    go.wait()
    with runlane.create_delivery_worker(concurrency=CONCURRENCY):
        stop.wait()
    runlane.close()


def most_in_a_window(starts: list[datetime], per: timedelta) -> int:
    best = j = 0
    for i, start in enumerate(starts):
        j = max(j, i)
        while j < len(starts) and starts[j] < start + per:
            j += 1
        best = max(best, j - i)
    return best


def rate_measure(url: str, count: int, burst: int | None, seconds: int) -> list[Row]:
    """Three worker processes on one rate-limited queue with ``seconds`` x ``count`` runs."""
    rate = RateLimit(count, timedelta(seconds=1), burst=burst)
    schema = fresh_schema(url)
    runs = count * seconds
    insert_queued(url, schema, runs, None, None)
    ctx = multiprocessing.get_context("spawn")
    stop, go = ctx.Event(), ctx.Event()
    readies = [ctx.Event() for _ in range(3)]
    procs = [
        ctx.Process(target=_rate_worker, args=(url, schema, rate, (ready, go, stop)))
        for ready in readies
    ]
    for proc in procs:
        proc.start()
    for ready in readies:
        ready.wait(60)
    go.set()
    wait_drained(url, schema, timeout=seconds * 3 + 60)
    stop.set()
    for proc in procs:
        proc.join(30)
    with psycopg.connect(url, autocommit=True) as conn:
        starts = [
            row[0]
            for row in conn.execute(
                f"select started_at from {schema}.runs where status = 'completed' "
                "order by started_at"
            )
        ]
        workers = conn.execute(f"select count(distinct worker_id) from {schema}.runs").fetchone()
    # the middle: from the first start + 1 s to the last start - 1 s (whole windows)
    first, last = starts[0] + timedelta(seconds=1), starts[-1] - timedelta(seconds=1)
    middle = [s for s in starts if first <= s < last]
    achieved = len(middle) / (last - first).total_seconds()
    most = most_in_a_window(starts, timedelta(seconds=1))
    label = f"RateLimit({count}, 1 s{'' if burst is None else f', burst={burst}'})"
    log(
        f"rate {label}: {achieved:.1f} starts/s in the middle {len(middle)} starts, most in "
        f"a second {most}, by {workers[0] if workers else '?'} workers of 3 processes"
    )
    bound = count + (burst or 0)
    return [
        ratio_row(
            f"{label}, 3 worker processes: achieved (starts/s)",
            achieved,
            "limit",
            count,
            0.95,
            fmt=",.1f",
        ),
        Row(
            f"  most starts in any 1 s window (limit {bound})",
            float(most),
            target=f"<= {bound}",
            met=most <= bound,
        ),
    ]


def bench_rate(url: str, args: argparse.Namespace) -> list[Row]:
    return [
        *rate_measure(url, args.rate, None, args.rate_seconds),
        *rate_measure(url, args.rate, 10, args.rate_seconds),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(MEASURES)}")
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--per-key", type=int, default=10)
    parser.add_argument("--hot", type=int, default=100_000)
    parser.add_argument("--waiting", type=int, default=100_000)
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured waiting")
    parser.add_argument("--rate", type=int, default=200, help="the rate limit's count a second")
    parser.add_argument("--rate-seconds", type=int, default=15, help="seconds of work at the rate")
    add_database_argument(parser)
    args = parser.parse_args(argv)
    only = set(MEASURES) if args.only is None else set(args.only.split(","))
    unknown = only - set(MEASURES)
    if unknown:
        parser.error(f"unknown measures {sorted(unknown)}; choose from {','.join(MEASURES)}")
    began = time.perf_counter()
    rows: list[Row] = []
    with server_url(args.database_url) as url:
        for name, bench in (
            ("keyed", bench_keyed),
            ("hol", bench_hol),
            ("waiting", bench_waiting),
            ("rate", bench_rate),
        ):
            if name in only:
                rows += bench(url, args)
    print_table(rows, [f"took {time.perf_counter() - began:.0f} s"], compare="compared with")
    return 0


if __name__ == "__main__":
    sys.exit(main())
