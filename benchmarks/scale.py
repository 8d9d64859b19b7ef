"""runlane at scale: claim and trigger throughput as the tables grow, and cleanup beside a
running claimer (issue 12, "flat as the tables grow"). Takes minutes at the full sizes.

    python -m benchmarks.scale [--phases depth,history,cleanup] [--measure 4000]
                               [--queued-small 10000] [--queued-large 1000000]
                               [--history 5000000] [--cleanup 1000000] [--window 10]
                               [--feed-rate 1000] [--cleanup-seconds 0] [--explain]
                               [--database-url URL]

Rows are generated with INSERT ... SELECT generate_series straight into runlane's tables,
shaped as runlane writes them (benchmarks/_bulk.py); everything measured goes through
runlane's own code:

- **depth**: claim throughput with ``--queued-large`` runs queued vs ``--queued-small``
  (target: >= 0.8x): ``--measure`` runs claimed 32 per claim through the storage's
  ``run_claim`` (the statement and connection setting a worker's claims use), then
  ``--measure`` runs processed by a delivery worker (concurrency 8, no-op handler), timed
  between handler starts after a warm-up of 500;
- **history**: the same claims, plus ``trigger`` one by one and ``trigger_many`` x1000, in a
  schema keeping ``--history`` completed runs (and their attempt rows, finished over the
  last 6 days, so within the default 7-day retention) vs an empty one (target: >= 0.8x);
- **cleanup**: ``--cleanup`` completed runs finished 8-10 days ago (past the default 7-day
  retention) are pruned by ``Runlane.run_maintenance_once()`` passes (the cleanup phase:
  1,000 runs a pass, in statements of 500) until none is left (or ``--cleanup-seconds``
  passed), while a feeder triggers ``--feed-rate`` runs/s (``trigger_many`` every 50 ms) and
  a delivery worker runs them. Every claim the worker makes is timed (target: the longest
  under 100 ms), and so are each run's trigger-to-start wait and each ``trigger_many`` call,
  beside a ``--window`` of seconds with the same load and no cleanup.

``--explain`` prints EXPLAIN (ANALYZE, BUFFERS) of a 32-run claim (rolled back) in each
depth and history setting, and of one cleanup statement, to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any

import attrs
import psycopg

from benchmarks._bulk import insert_finished, insert_queued
from benchmarks._common import (
    CONCURRENCY,
    Row,
    add_database_argument,
    fresh_schema,
    log,
    pct,
    print_table,
    ratio_row,
    runtime,
    server_url,
)
from runlane import MaintenanceLimits, RunContext, Runlane, task
from runlane.postgres import postgres_polling_lane
from runlane.postgres._attempts import AttemptRepository
from runlane.postgres._sql import statements

PHASES = ("depth", "history", "cleanup")
TASK_ID = "bench.count"
WARM = 500
LEASE = timedelta(seconds=30)
CLAIM_BATCH = 4 * CONCURRENCY  # a worker's default claim batch

# handler start times (perf_counter) of the measured worker; list.append is atomic
_starts: list[float] = []


@task(id=TASK_ID)
def count(payload: Any, context: RunContext) -> None:
    _starts.append(time.perf_counter())


def claim_rate(url: str, schema: str, runs: int) -> float:
    """Runs/s claimed ``CLAIM_BATCH`` at a time through ``run_claim`` on a dedicated
    connection with asynchronous commit (as a worker's acquirer claims)."""
    lane = postgres_polling_lane(connection_string=url, schema=schema)
    base = lane.create_storage()
    storage = base.dedicated("bench-claims", durable_commits=False)
    try:
        storage.run_claim("default", ["default"], 1, LEASE)  # connect
        claimed = 0
        started = time.perf_counter()
        while claimed < runs:
            got = storage.run_claim("default", ["default"], CLAIM_BATCH, LEASE)
            if not got:
                raise RuntimeError(f"the queue ran dry after {claimed} claims")
            claimed += len(got)
        return claimed / (time.perf_counter() - started)
    finally:
        storage.close()
        base.close()


def worker_rate(runlane: Runlane, runs: int, timeout: float = 900) -> float:
    """Runs/s of a delivery worker (concurrency 8) between the handler starts number
    ``WARM`` and ``WARM + runs``."""
    _starts.clear()
    deadline = time.monotonic() + timeout
    with runlane.create_delivery_worker(concurrency=CONCURRENCY):
        while len(_starts) < WARM + runs:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(_starts)} runs started")
            time.sleep(0.01)
    return runs / (_starts[WARM + runs - 1] - _starts[WARM - 1])


def trigger_rate(runlane: Runlane, count_: int) -> float:
    started = time.perf_counter()
    for i in range(count_):
        runlane.trigger(TASK_ID, {"order": i})
    return count_ / (time.perf_counter() - started)


def trigger_many_rate(runlane: Runlane, batches: int) -> float:
    started = time.perf_counter()
    for b in range(batches):
        runlane.trigger_many(TASK_ID, [{"order": b * 1000 + i} for i in range(1000)])
    return batches * 1000 / (time.perf_counter() - started)


def _literal_claim(schema: str) -> str:
    sql = statements(schema)["run_claim"]
    values = {
        "environment": "'default'",
        "queues": "array['default']",
        "limit": str(CLAIM_BATCH),
        "lease_seconds": "30",
        "concurrency_limit": "null",
    }
    for name, value in values.items():
        sql = sql.replace(f"%({name})s", value)
    return sql


def explain(url: str, sql: str, title: str) -> None:
    """EXPLAIN (ANALYZE, BUFFERS) of ``sql`` inside a transaction that is rolled back."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(f"explain (analyze, buffers) {sql}").fetchall()
        conn.rollback()
    log(f"--- EXPLAIN ANALYZE: {title}")
    for (line,) in rows:
        print(f"    {line}", file=sys.stderr)
    sys.stderr.flush()


def _setting(label: str, fn: Callable[[], float]) -> float:
    value = fn()
    log(f"{label:<62} {value:>12,.0f}")
    return value


# -- depth ------------------------------------------------------------------------------


def phase_depth(url: str, args: argparse.Namespace) -> list[Row]:
    figures: dict[int, tuple[float, float]] = {}
    for queued in (args.queued_small, args.queued_large):
        if queued < 2 * args.measure + WARM + 1000:
            raise SystemExit(f"--queued-small must be at least {2 * args.measure + WARM + 1000}")
        schema = fresh_schema(url)
        took = insert_queued(url, schema, queued, task_id=TASK_ID)
        log(f"{queued:,} queued runs generated in {took:.0f} s")
        if args.explain:
            explain(url, _literal_claim(schema), f"claim of {CLAIM_BATCH}, {queued:,} queued")
        claims = _setting(
            f"claim only, {queued:,} queued (runs/s)",
            partial(claim_rate, url, schema, args.measure),
        )
        with runtime(url, schema, tasks=[count]) as runlane:
            worker = _setting(
                f"worker, {queued:,} queued (runs/s)",
                partial(worker_rate, runlane, args.measure),
            )
        figures[queued] = (claims, worker)
        _drop(url, schema)
    small, large = figures[args.queued_small], figures[args.queued_large]
    base = f"{args.queued_small:,} queued"
    return [
        ratio_row(f"claim only, 32 per claim, {args.queued_large:,} queued (runs/s)",
                  large[0], base, small[0], 0.8),
        ratio_row(f"worker processing, {args.queued_large:,} queued (runs/s)",
                  large[1], base, small[1], 0.8),
    ]  # fmt: skip


# -- history ----------------------------------------------------------------------------


def phase_history(url: str, args: argparse.Namespace) -> list[Row]:
    figures: dict[int, dict[str, float]] = {}
    for kept in (0, args.history):
        schema = fresh_schema(url)
        if kept:
            took = insert_finished(
                url, schema, kept, oldest_days=6, newest_days=0.1, task_id=TASK_ID
            )
            log(f"{kept:,} finished runs (and attempts) generated in {took:.0f} s")
        insert_queued(url, schema, 2 * args.measure + WARM + 1000, task_id=TASK_ID)
        if args.explain:
            explain(url, _literal_claim(schema), f"claim of {CLAIM_BATCH}, {kept:,} finished kept")
        row: dict[str, float] = {}
        with runtime(url, schema, tasks=[count]) as runlane:
            runlane.trigger(TASK_ID, None)  # connect first
            row["trigger"] = _setting(
                f"trigger one by one, {kept:,} kept (runs/s)",
                partial(trigger_rate, runlane, args.triggers),
            )
            row["trigger_many"] = _setting(
                f"trigger_many x1000, {kept:,} kept (runs/s)",
                partial(trigger_many_rate, runlane, args.batches),
            )
            row["claim"] = _setting(
                f"claim only, {kept:,} kept (runs/s)",
                partial(claim_rate, url, schema, args.measure),
            )
            row["worker"] = _setting(
                f"worker, {kept:,} kept (runs/s)",
                partial(worker_rate, runlane, args.measure),
            )
        figures[kept] = row
        _drop(url, schema)
    empty, full = figures[0], figures[args.history]
    kept_label = f"{args.history:,} finished kept"
    labels = {
        "trigger": "trigger one by one",
        "trigger_many": "trigger_many, 1,000 per call",
        "claim": "claim only, 32 per claim",
        "worker": "worker processing",
    }
    return [
        ratio_row(f"{text}, {kept_label} (runs/s)", full[key], "empty history", empty[key], 0.8)
        for key, text in labels.items()
    ]


# -- cleanup ----------------------------------------------------------------------------


@contextmanager
def timed_claims() -> Iterator[list[tuple[float, float]]]:
    """Record (start, seconds) of every ``run_claim`` call of the Postgres storage meanwhile."""
    record: list[tuple[float, float]] = []
    original = AttemptRepository.run_claim

    def run_claim(self: AttemptRepository, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            record.append((began, time.perf_counter() - began))

    AttemptRepository.run_claim = run_claim  # type: ignore[method-assign]
    try:
        yield record
    finally:
        AttemptRepository.run_claim = original  # type: ignore[method-assign]


# the cleanup phase's runs: (handler start, seconds since their trigger_many call began)
_waits: list[tuple[float, float]] = []


@task(id="bench.timed")
def timed_run(payload: Any, context: RunContext) -> None:
    now = time.perf_counter()
    _waits.append((now, now - payload["t"]))


class Feeder(threading.Thread):
    """Triggers ``rate`` runs/s, in ``trigger_many`` calls of ``rate // 20`` every 50 ms, each
    run's payload carrying the call's start time; records (start, seconds) of each call."""

    def __init__(self, runlane: Runlane, rate: int) -> None:
        super().__init__(name="bench-feeder", daemon=True)
        self.runlane = runlane
        self.batch = max(1, rate // 20)
        self.calls: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        tick = time.perf_counter()
        while not self.stop.is_set():
            began = time.perf_counter()
            self.runlane.trigger_many(timed_run, [{"t": began}] * self.batch)
            self.calls.append((began, time.perf_counter() - began))
            tick += 0.05
            self.stop.wait(max(0.0, tick - time.perf_counter()))


@attrs.frozen
class Window:
    """What happened between ``since`` and ``until``."""

    since: float
    until: float

    def of(self, events: list[tuple[float, float]]) -> list[float]:
        """The durations (ms) of the events that began inside."""
        return [d * 1000 for s, d in events if self.since <= s < self.until]

    @property
    def seconds(self) -> float:
        return self.until - self.since


def compare_row(
    label: str,
    during: list[float],
    quiet: list[float],
    q: float | None,
    baseline: str = "no cleanup",
) -> Row:
    """Row of the longest (q None) or a percentile of ``during`` beside ``quiet`` (ms), the
    window without the action measured (``baseline`` names it)."""
    d = max(during) if q is None else pct(during, q)
    b = max(quiet) if q is None else pct(quiet, q)
    return Row(label, d, ",.1f", baseline, b, d / b if b else None)


@contextmanager
def fed(
    runlane: Runlane, rate: int, window: float, **worker: Any
) -> Iterator[tuple[Feeder, Window]]:
    """A delivery worker (concurrency 8; ``worker`` options besides) serving ``timed_run``
    runs a ``Feeder`` triggers at ``rate`` runs/s. After a 2 s warm-up and ``window``
    seconds of that load alone (the baseline), yields the feeder and that quiet window;
    stops the feeder and the worker on leaving."""
    runlane.trigger(timed_run, {"t": time.perf_counter()})  # connect first
    feeder = Feeder(runlane, rate)
    delivery = runlane.create_delivery_worker(concurrency=CONCURRENCY, **worker)
    feeder.start()
    try:
        time.sleep(2)  # warm up
        quiet = Window(time.perf_counter(), time.perf_counter() + window)
        time.sleep(window)
        yield feeder, quiet
    finally:
        feeder.stop.set()
        delivery.close()
        feeder.join(30)


def _finished(url: str, schema: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            f"select count(*) from {schema}.runs where environment = 'default' "
            "and status in ('completed', 'failed', 'cancelled') and pruned_at is null "
            "and finished_at < now() - interval '7 days'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def _explain_prune(url: str, schema: str, count: int) -> None:
    sql = statements(schema)["run_prune"]
    for name, value in {
        "environment": "'default'",
        "limit": "500",
        "completed_seconds": str(7 * 86400),
        "failed_seconds": str(30 * 86400),
        "cancelled_seconds": str(30 * 86400),
    }.items():
        sql = sql.replace(f"%({name})s", value)
    explain(url, sql, f"one cleanup statement (500 runs), {count:,} past retention")


def phase_cleanup(url: str, args: argparse.Namespace) -> list[Row]:
    schema = fresh_schema(url)
    took = insert_finished(
        url, schema, args.cleanup, oldest_days=10, newest_days=8, task_id=TASK_ID
    )
    log(f"{args.cleanup:,} finished runs past retention generated in {took:.0f} s")
    if args.explain:
        _explain_prune(url, schema, args.cleanup)
    _waits.clear()
    passes: list[tuple[float, float]] = []
    pruned = 0
    with runtime(url, schema, tasks=[timed_run]) as runlane, timed_claims() as claims:
        with fed(runlane, args.feed_rate, args.window) as (feeder, quiet):
            began = time.perf_counter()
            limits = MaintenanceLimits()
            while True:
                t = time.perf_counter()
                result = runlane.run_maintenance_once(limits)
                passes.append((t, time.perf_counter() - t))
                pruned += result.runs_pruned + result.runs_tombstoned
                if result.runs_pruned + result.runs_tombstoned == 0:
                    break
                if args.cleanup_seconds and time.perf_counter() - began > args.cleanup_seconds:
                    log(f"cleanup: stopped after --cleanup-seconds {args.cleanup_seconds:g}")
                    break
                if len(passes) % 50 == 0:
                    log(f"cleanup: {pruned:,} pruned ({time.perf_counter() - began:.0f} s)")
            during = Window(began, time.perf_counter())
        left = _finished(url, schema)
    _drop(url, schema)
    longest_pass = max(d for _, d in passes) * 1000
    log(
        f"cleanup: {pruned:,} runs pruned in {during.seconds:.1f} s over {len(passes)} passes "
        f"(longest pass {longest_pass:.0f} ms), {left:,} left past retention; "
        f"{len(during.of(_waits)):,} runs started meanwhile; claims: "
        f"{len(quiet.of(claims))} without cleanup, {len(during.of(claims))} during"
    )
    status = "all pruned" if left == 0 else f"stopped with {left:,} left"
    longest = max(during.of(claims))
    quiet_longest = max(quiet.of(claims))
    return [
        Row(f"cleanup of {args.cleanup:,} finished runs (runs pruned/s; {status} in "
            f"{during.seconds:.0f} s)", pruned / during.seconds),
        Row("cleanup: longest maintenance pass, 1,000 runs (ms)", longest_pass, ",.1f"),
        Row(f"longest claim during cleanup, {args.feed_rate:,} runs/s fed (ms)", longest, ",.1f",
            "no cleanup", quiet_longest, longest / quiet_longest, "< 100 ms", longest < 100),
        compare_row("claim p99 during cleanup (ms)", during.of(claims), quiet.of(claims), 0.99),
        compare_row("trigger-to-start, longest during cleanup (ms)", during.of(_waits),
                 quiet.of(_waits), None),
        compare_row("trigger-to-start p99 during cleanup (ms)", during.of(_waits),
                 quiet.of(_waits), 0.99),
        compare_row("trigger_many call, longest during cleanup (ms)", during.of(feeder.calls),
                 quiet.of(feeder.calls), None),
    ]  # fmt: skip


def _drop(url: str, schema: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"drop schema {schema} cascade")
        conn.execute("checkpoint")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset")
    parser.add_argument("--measure", type=int, default=4000, help="runs claimed per figure")
    parser.add_argument("--queued-small", type=int, default=10_000)
    parser.add_argument("--queued-large", type=int, default=1_000_000)
    parser.add_argument("--history", type=int, default=5_000_000, help="finished runs kept")
    parser.add_argument("--triggers", type=int, default=3000, help="one-by-one triggers")
    parser.add_argument("--batches", type=int, default=20, help="trigger_many calls of 1,000")
    parser.add_argument("--cleanup", type=int, default=1_000_000, help="finished runs pruned")
    parser.add_argument("--window", type=float, default=10, help="seconds without cleanup")
    parser.add_argument(
        "--feed-rate", type=int, default=1000, help="runs/s triggered during cleanup"
    )
    parser.add_argument(
        "--cleanup-seconds",
        type=float,
        default=0,
        help="stop cleanup after this many seconds (0: until every run is pruned)",
    )
    parser.add_argument("--explain", action="store_true", help="EXPLAIN ANALYZE to stderr")
    add_database_argument(parser)
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"--phases: unknown {sorted(unknown)}; choose from {PHASES}")
    log(f"scale: {vars(args)}; load average {os.getloadavg()[0]:.2f}")
    began = time.perf_counter()
    work = {"depth": phase_depth, "history": phase_history, "cleanup": phase_cleanup}
    rows: list[Row] = []
    with server_url(args.database_url) as url:
        for phase in phases:
            rows += work[phase](url, args)
    print_table(
        rows,
        [f"took {time.perf_counter() - began:.0f} s; load average after {os.getloadavg()[0]:.2f}"],
        compare="compared with",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
