"""Metrics over time (issue 39): the per-minute rollup the maintenance band ``stats`` keeps,
read by ``Runlane.stats`` and ``runlane stats``. The rollup's figures are checked against a
scan of runs and attempts on a data set with known waits and run times (the test's clock
moved, never slept); retention prunes it; bad windows are refused in one line."""

from __future__ import annotations

import json
import queue
import threading
import uuid
from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql

from runlane import (
    ConfigurationError,
    MaintenanceLimits,
    RetentionPolicy,
    RetryPolicy,
    RunContext,
    Runlane,
    RunStatus,
    StaleLease,
    Task,
    task,
)
from runlane.cli import main
from runlane.stats import HISTOGRAM_BOUNDS, Histogram, Stats, histogram_index
from runlane.storage import MaintenanceFence
from runlane.testing import MovableClock
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, poll, storage_of

_clock: MovableClock | None = None  # the running test's, which the handlers move

ONCE_THEN_FAIL = RetryPolicy(
    max_attempts=2, initial_delay=timedelta(seconds=20), max_delay=timedelta(seconds=20), jitter=0
)


@task(id="stats.work")
def work(payload: dict[str, Any], context: RunContext) -> None:
    assert _clock is not None
    _clock.advance(payload["seconds"])  # the run time, in moved database time


@task(id="stats.flaky", retry=ONCE_THEN_FAIL)
def flaky(payload: dict[str, Any], context: RunContext) -> None:
    assert _clock is not None
    _clock.advance(payload["seconds"])
    raise RuntimeError("always")


@task(id="stats.doomed", retry=RetryPolicy(max_attempts=1))
def doomed(payload: dict[str, Any], context: RunContext) -> None:
    raise RuntimeError("always")


TASKS: list[Task[Any, Any]] = [work, flaky]


def _minute(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(second=0, microsecond=0)


def _scan(db: Conn, schema: str) -> dict[tuple[datetime, str], dict[str, Any]]:
    """The figures of every minute and task, from the runs and attempts rows themselves
    (what the rollup must equal): plain Python over every row."""
    runs = db.execute(
        sql.SQL(
            "select id, task_id, status, created_at, finished_at, due_at, attempt_started_at, "
            "attempt, lease_token from {}.runs"
        ).format(sql.Identifier(schema))
    ).fetchall()
    attempts = db.execute(
        sql.SQL("select run_id, attempt, outcome, started_at from {}.attempts").format(
            sql.Identifier(schema)
        )
    ).fetchall()
    by_id = {r[0]: r for r in runs}
    out: dict[tuple[datetime, str], dict[str, Any]] = defaultdict(
        lambda: {
            "triggered": 0,
            "started": 0,
            "retried": 0,
            "completed": 0,
            "failed": 0,
            "cancelled": 0,
            "wait": [],
            "run": [],
        }
    )
    for run_id, task_id, status, created, finished, due, attempt_started, _, lease in runs:
        out[(_minute(created), task_id)]["triggered"] += 1
        if status in ("running", "cancellation_requested") and lease is not None:
            out[(_minute(attempt_started), task_id)]["started"] += 1
        if status in ("completed", "failed", "cancelled"):
            row = out[(_minute(finished), task_id)]
            row[status] += 1
            if status != "cancelled" and attempt_started is not None:
                row["wait"].append(max(0.0, (attempt_started - due).total_seconds()))
                row["run"].append(max(0.0, (finished - attempt_started).total_seconds()))
        del run_id
    for run_id, number, outcome, started in attempts:
        run = by_id[run_id]
        row = out[(_minute(started), run[1])]
        row["started"] += 1
        moved_on = run[7] > number or run[2] == "retrying"
        if outcome == "retrying" or (outcome == "expired" and moved_on):
            row["retried"] += 1
    return out


def _histogram(values: list[float]) -> Histogram:
    counts = Counter(histogram_index(v) for v in values)
    return Histogram(tuple(counts.get(i, 0) for i in range(len(HISTOGRAM_BOUNDS) + 1)), sum(values))


def _by_minute(stats: Stats) -> dict[datetime, Any]:
    return {b.start: b for b in stats.buckets if b != type(b)(start=b.start)}


def _data_set(rl: Runlane, clock: MovableClock) -> None:
    """Runs with known waits and run times, one at a time: three that complete after
    waiting 10 s, running 0.25 s, 4 s and 45 s; one that fails after 10 s and 1.5 s,
    retries 20 s later at once and fails for good after 1.5 s more; one cancelled while
    queued; one claimed and still running."""
    for seconds in (0.25, 4.0, 45.0):
        rl.trigger(work, {"seconds": seconds})
        clock.advance(10)
        rl.drain()
    rl.trigger(flaky, {"seconds": 1.5})
    clock.advance(10)
    rl.drain()
    clock.advance(20)
    # the retry comes due, and is delivered; no fold yet: runs.created_at is the server's
    # time, not the moved clock's, and a fold now would take those minutes as final
    rl.run_maintenance_once(MaintenanceLimits(stats_minutes=0))
    rl.drain()
    rl.cancel(rl.trigger(work, {"seconds": 0}).id)
    # and one still running when the fold comes: its attempt counts as started
    rl.trigger(work, {"seconds": 0})
    (live,) = storage_of(rl).run_claim(rl.environment, ["default"], 1, timedelta(hours=1))
    assert live.attempt == 1
    clock.advance(60)  # the minutes of the data set close: the next fold takes them


@pytest.fixture
def moved(clock: MovableClock) -> Any:
    global _clock  # noqa: PLW0603 - the handlers' reach to the test's clock
    _clock = clock
    yield clock
    _clock = None


def test_the_rollup_equals_a_scan_of_runs(
    make_runlane: RunlaneFactory, moved: MovableClock, db: Conn, schema: str
) -> None:
    rl = make_runlane(tasks=TASKS)
    start = rl.stats().until
    _data_set(rl, moved)
    scan = _scan(db, schema)  # the history, before an operator changes it
    assert scan  # the data set made figures
    # before the first fold: the failed run and the cancelled one are retried (queued
    # again, their finishes gone from runs), the 45 s one deleted with its attempt
    finished = sql.SQL(
        "select id, status from {}.runs where status in ('failed', 'cancelled') "
        "or (status = 'completed' and finished_at - attempt_started_at > interval '40 s')"
    ).format(sql.Identifier(schema))
    changed = dict(db.execute(finished).fetchall())
    assert sorted(changed.values()) == ["cancelled", "completed", "failed"]
    for run_id, status in changed.items():
        if status == "completed":
            assert rl.delete_run(run_id)
        else:
            rl.retry_run(run_id)
    assert _scan(db, schema) != scan  # a scan now would tell another story
    assert rl.run_maintenance_once().stats_pruned == 0
    stats = rl.stats(since=start - timedelta(minutes=1), bucket="1m")
    per_task = [rl.stats(since=start - timedelta(minutes=1), bucket="1m", task=t.id) for t in TASKS]
    for task_stats in per_task:
        found = _by_minute(task_stats)
        wanted = {m: row for (m, t), row in scan.items() if t == task_stats.task}
        assert set(found) == set(wanted)
        for minute, row in wanted.items():
            got = found[minute]
            figures = ("triggered", "started", "retried", "completed", "failed", "cancelled")
            assert {f: getattr(got, f) for f in figures} == {f: row[f] for f in figures}
            assert got.wait.counts == _histogram(row["wait"]).counts
            assert got.run_time.counts == _histogram(row["run"]).counts
            assert got.wait.sum == pytest.approx(sum(row["wait"]), abs=1e-6)
            assert got.run_time.sum == pytest.approx(sum(row["run"]), abs=1e-6)
    # the known data set, read from the totals of every task and minute
    totals = stats.totals
    # the 15- and 60-minute spans hold the same figures, summed
    for bucket in ("15m", "1h"):
        longer = rl.stats(since=start - timedelta(minutes=1), bucket=bucket).totals
        for histogram in ("wait", "run_time"):  # sums of sums: equal but for rounding
            assert getattr(longer, histogram).sum == pytest.approx(getattr(totals, histogram).sum)
        wait = attrs.evolve(longer.wait, sum=totals.wait.sum)
        run_time = attrs.evolve(longer.run_time, sum=totals.run_time.sum)
        assert attrs.evolve(longer, start=totals.start, wait=wait, run_time=run_time) == totals
    assert (totals.triggered, totals.completed, totals.failed, totals.cancelled) == (6, 3, 1, 1)
    assert (totals.started, totals.retried) == (6, 1)
    assert totals.wait.count == totals.run_time.count == 4
    waits = sorted(v for row in scan.values() for v in row["wait"])
    runs = sorted(v for row in scan.values() for v in row["run"])
    # what the clock was moved by, plus the little real time that passed meanwhile
    assert waits == [pytest.approx(w, abs=0.5) for w in (0, 10, 10, 10)]
    assert runs == [pytest.approx(r, abs=0.5) for r in (0.25, 1.5, 4, 45)]
    # percentiles interpolate within a bucket (bounds a factor of sqrt(2) apart)
    p50 = totals.run_time.percentile(0.5)
    assert p50 is not None
    assert 1.5 / 1.42 <= p50 <= 1.5 * 1.42
    assert totals.run_time.percentile(1.0) == pytest.approx(45, rel=0.42)
    assert totals.wait.percentile(0.75) == pytest.approx(10, rel=0.42)


def test_a_fold_again_changes_nothing_and_retention_prunes(
    make_runlane: RunlaneFactory, moved: MovableClock
) -> None:
    rl = make_runlane(tasks=TASKS, retention=RetentionPolicy(stats=timedelta(hours=1)))
    since = rl.stats().until - timedelta(minutes=1)
    _data_set(rl, moved)
    rl.run_maintenance_once()
    first = rl.stats(since=since, bucket="5m")
    rl.run_maintenance_once()
    again = rl.stats(since=since, until=first.until, bucket="5m")
    assert again.buckets == first.buckets
    assert first.totals.triggered == 6
    moved.advance(2 * 3600)  # past retention: the next pass prunes what the rollup held
    pruned = rl.run_maintenance_once(MaintenanceLimits(stats_minutes=0))
    assert pruned.stats_pruned > 0
    gone = rl.stats(since=since, until=first.until, bucket="5m")
    assert gone.totals.triggered == 0


def test_buckets_cover_the_window_and_a_queue_filters(
    make_runlane: RunlaneFactory, moved: MovableClock
) -> None:
    rl = make_runlane(tasks=TASKS)
    until = datetime(2026, 12, 1, 10, 7, 30, tzinfo=UTC)
    hour = rl.stats(since=until - timedelta(hours=1), until=until)
    assert hour.bucket == timedelta(minutes=1)
    assert len(hour.buckets) == 61
    assert hour.buckets[0].start == datetime(2026, 12, 1, 9, 7, tzinfo=UTC)
    assert rl.stats(since=until - timedelta(days=1), until=until).bucket == timedelta(minutes=15)
    week = rl.stats(since=until - timedelta(days=7), until=until)
    assert week.bucket == timedelta(hours=1)
    assert len(week.buckets) == 169
    since = rl.stats().until - timedelta(minutes=1)
    _data_set(rl, moved)
    rl.run_maintenance_once()
    assert rl.stats(since=since, queue="default").totals.triggered == 6
    assert rl.stats(since=since, queue="elsewhere").totals.triggered == 0
    as_dict = rl.stats(since=since, task="stats.flaky").to_dict()
    assert (as_dict["totals"]["failed"], as_dict["totals"]["retried"]) == (1, 1)
    assert json.loads(json.dumps(as_dict)) == as_dict


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"since": datetime(2026, 1, 2, tzinfo=UTC), "until": datetime(2026, 1, 1, tzinfo=UTC)},
            "must be before until",
        ),
        (
            {"since": datetime(2026, 1, 1, tzinfo=UTC), "until": datetime(2026, 1, 1, tzinfo=UTC)},
            "must be before until",
        ),
        ({"bucket": "2m"}, "bucket must be one of 1m, 5m, 15m, 1h, 6h, 1d"),
        ({"bucket": timedelta(minutes=2)}, "bucket must be one of"),
        ({"since": datetime(2026, 1, 1)}, "since must be a timezone-aware datetime"),
        ({"until": "yesterday"}, "until must be a timezone-aware datetime"),
        ({"since": datetime(2020, 1, 1, tzinfo=UTC), "bucket": "1m"}, "at most 10080"),
        ({"queue": ""}, "queue"),
        ({"window": 3}, "stats() takes queue, task, since, until and bucket"),
    ],
)
def test_bad_windows_are_refused_in_one_line(
    make_runlane: RunlaneFactory, options: dict[str, Any], message: str
) -> None:
    rl = make_runlane(tasks=TASKS)
    with pytest.raises(ConfigurationError, match=r"^[^\n]*$") as caught:
        rl.stats(**options)
    assert message in str(caught.value)


def test_runlane_stats_on_the_command_line(
    make_runlane: RunlaneFactory,
    moved: MovableClock,
    capsys: pytest.CaptureFixture[str],
    database_url: str,
    schema: str,
) -> None:
    rl = make_runlane(tasks=TASKS)
    since = rl.stats().until - timedelta(minutes=1)
    _data_set(rl, moved)
    rl.run_maintenance_once()
    # the command's runtime reads the real clock: the window is given (the data set's
    # minutes are on the test's moved clock, a few minutes ahead)
    window = ["--since", since.isoformat(), "--until", (since + timedelta(hours=1)).isoformat()]
    target = ["--database-url", database_url, "--schema", schema, *window]
    assert main(["stats", *target, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["totals"]["completed"], data["bucket_seconds"]) == (3, 60)
    assert main(["stats", *target, "--task", "stats.flaky"]) == 0
    text = capsys.readouterr().out
    assert all(part in text for part in ("failed 1", "retried 1", "task stats.flaky"))
    assert main(["stats", *target, "--bucket", "2m"]) == 2
    assert "bucket must be one of" in capsys.readouterr().err
    assert main(["stats", *target[:4], "--since", "yesterday"]) == 2
    assert "--since must be a time like" in capsys.readouterr().err


def test_a_late_write_counts_when_it_lands_in_the_minute_before_the_last_fold(
    make_runlane: RunlaneFactory, moved: MovableClock, db: Conn, schema: str
) -> None:
    """Each minute is computed when it has closed and once more when the next one has: a
    write that commits late into a minute already folded is counted by the next fold; one
    older than that is not (docs/observability.md says so)."""
    rl = make_runlane(tasks=TASKS)
    rl.run_maintenance_once()  # the first fold: every minute before the current one
    now = rl.stats().until
    current = now.replace(second=0, microsecond=0)
    late = sql.SQL(
        "insert into {}.runs (id, environment, task_id, queue, status, payload, max_attempts, "
        "due_at, created_at) values (gen_random_uuid(), 'default', 'stats.work', 'default', "
        "'queued', '{{}}', 1, %s, %s)"
    ).format(sql.Identifier(schema))
    for minutes_back in (1, 3):  # the minute the last fold closed, and one before it
        at = current - timedelta(minutes=minutes_back, seconds=-20)
        db.execute(late, (at, at))
    moved.advance(60)  # the current minute closes
    rl.run_maintenance_once()
    counted = rl.stats(since=current - timedelta(minutes=5), bucket="1m")
    found = {b.start: b.triggered for b in counted.buckets if b.triggered}
    assert found == {current - timedelta(minutes=1): 1}


def test_a_stale_band_owner_folds_nothing(
    make_runlane: RunlaneFactory, moved: MovableClock, db: Conn, schema: str
) -> None:
    """The fold and the prune are fenced like every maintenance write: a replica whose lease
    of the stats band is gone writes nothing."""
    rl = make_runlane(tasks=TASKS)
    _data_set(rl, moved)
    storage = storage_of(rl)
    stale = MaintenanceFence(rl.environment, "stats", uuid.uuid4(), 7)
    with pytest.raises(StaleLease):
        storage.stats_fold(rl.environment, timedelta(minutes=5), 60, fence=stale)
    with pytest.raises(StaleLease):
        storage.stats_prune(rl.environment, timedelta(0), 100, fence=stale)
    rows = sql.SQL("select count(*) from {}.stats_rollup").format(sql.Identifier(schema))
    assert db.execute(rows).fetchone() == (0,)
    rl.run_maintenance_once()  # no fence: the rows are written
    assert db.execute(rows).fetchone() != (0,)


@pytest.mark.parametrize("change", ["retry", "delete"])
def test_runs_retried_or_deleted_after_the_first_fold_keep_their_counts(
    make_runlane: RunlaneFactory, moved: MovableClock, change: str
) -> None:
    """The rollup counts history: three runs fail, their minute is folded, then they are
    retried (failed runs queued again) or deleted (with their attempts); the second fold of
    that minute, a minute later, adds what it finds missing and takes nothing away."""
    rl = make_runlane(tasks=[doomed])
    since = rl.stats().until - timedelta(minutes=1)
    for _ in range(3):
        rl.trigger(doomed, {})
    rl.drain()
    moved.advance(60)  # their minute closes
    rl.run_maintenance_once()  # its first fold
    first = rl.stats(since=since, bucket="1m")
    figures = (first.totals.triggered, first.totals.started, first.totals.failed)
    assert figures == (3, 3, 3)
    assert first.totals.run_time.count == first.totals.wait.count == 3
    changed = rl.retry_runs(status="failed") if change == "retry" else rl.delete_runs(all=True)
    assert changed.changed == 3
    moved.advance(60)  # the next minute closes: the second fold recomputes the first one
    rl.run_maintenance_once()
    assert rl.stats(since=since, until=first.until, bucket="1m").buckets == first.buckets
    if change == "retry":  # the retried runs fail again, counted in their own minute
        rl.drain()
        moved.advance(60)
        rl.run_maintenance_once()
        totals = rl.stats(since=since, bucket="1m").totals
        assert (totals.triggered, totals.started, totals.failed) == (3, 6, 6)
        assert totals.run_time.count == 6


def test_a_finish_committed_late_adds_to_the_finishes_already_folded(
    make_runlane: RunlaneFactory, moved: MovableClock, db: Conn, schema: str
) -> None:
    """When the second fold of a minute counts more finishes than the first (a completion
    committed after the first fold, dated in that minute), its finishes replace the first's:
    the counts and both histograms of the two runs."""
    rl = make_runlane(tasks=[doomed])
    since = rl.stats().until - timedelta(minutes=1)
    failed = rl.trigger(doomed, {})
    rl.drain()
    moved.advance(60)
    rl.run_maintenance_once()
    folded = rl.stats(since=since, bucket="1m")
    first = folded.totals
    assert (first.triggered, first.completed, first.failed, first.run_time.count) == (1, 0, 1, 1)
    finished_at = rl.get_run(failed.id).finished_at
    assert finished_at is not None
    late = sql.SQL(
        "insert into {}.runs (id, environment, task_id, queue, status, payload, max_attempts, "
        "attempt, due_at, attempt_started_at, created_at, finished_at) values "
        "(gen_random_uuid(), 'default', 'stats.doomed', 'default', 'completed', '{{}}', 1, 1, "
        "%(at)s, %(at)s + interval '2 seconds', %(at)s, %(at)s + interval '5 seconds')"
    ).format(sql.Identifier(schema))
    at = finished_at.replace(second=0, microsecond=0)  # in the same minute, 2 s wait, 3 s run
    db.execute(late, {"at": at})
    moved.advance(60)
    rl.run_maintenance_once()
    again = rl.stats(since=since, until=folded.until, bucket="1m").totals
    assert (again.triggered, again.completed, again.failed) == (2, 1, 1)
    assert again.run_time.count == again.wait.count == 2
    assert again.run_time.sum == pytest.approx(first.run_time.sum + 3)
    assert again.wait.sum == pytest.approx(first.wait.sum + 2)


def _assert_rollup_is(rl: Runlane, since: datetime, history: dict[Any, dict[str, Any]]) -> None:
    figures = ("triggered", "started", "retried", "completed", "failed", "cancelled")
    for task_id in {t for _, t in history}:
        found = _by_minute(rl.stats(since=since, bucket="1m", task=task_id))
        wanted = {m: row for (m, t), row in history.items() if t == task_id}
        assert set(found) == set(wanted)
        for minute, row in wanted.items():
            got = found[minute]
            assert {f: getattr(got, f) for f in figures} == {f: row[f] for f in figures}
            assert got.wait.counts == _histogram(row["wait"]).counts
            assert got.run_time.counts == _histogram(row["run"]).counts


def test_tombstones_deleted_children_and_a_cancelled_retry_keep_their_counts(
    make_runlane: RunlaneFactory, moved: MovableClock, db: Conn, schema: str
) -> None:
    """Before the first fold of their minute: a finished parent is deleted while its child
    lives (it becomes a tombstone, whose finish the fold leaves out), then the child with its
    attempt; a run whose lease lapsed (retrying, its attempt expired) is cancelled. The
    rollup equals the history; the records of what they removed go once final."""
    rl = make_runlane(tasks=TASKS)
    since = rl.stats().until - timedelta(minutes=1)
    finished = sql.SQL(
        "insert into {}.runs (id, environment, task_id, queue, status, payload, max_attempts, "
        "attempt, due_at, attempt_started_at, created_at, finished_at, parent_run_id) values "
        "(%(id)s, 'default', 'stats.work', 'default', %(status)s, '{{}}', 1, 1, %(at)s, "
        "%(at)s + interval '2 s', %(at)s, %(at)s + interval '5 s', %(parent)s)"
    ).format(sql.Identifier(schema))
    attempt = sql.SQL(
        "insert into {}.attempts (run_id, attempt, lease_token, outcome, started_at, "
        "finished_at) values (%s, 1, gen_random_uuid(), 'failed', %s, %s)"
    ).format(sql.Identifier(schema))
    at = rl.stats().until - timedelta(seconds=30)
    parent, child = uuid.uuid4(), uuid.uuid4()
    db.execute(finished, {"id": parent, "status": "completed", "at": at, "parent": None})
    db.execute(finished, {"id": child, "status": "failed", "at": at, "parent": parent})
    db.execute(attempt, (child, at + timedelta(seconds=2), at + timedelta(seconds=5)))
    lapsed = rl.trigger(flaky, {"seconds": 0})
    (claimed,) = storage_of(rl).run_claim(rl.environment, ["default"], 1, timedelta(seconds=1))
    assert claimed.id == lapsed.id
    moved.advance(5)
    rl.run_maintenance_once(MaintenanceLimits(stats_minutes=0))  # the lease lapses
    assert rl.get_run(lapsed.id).status.value == "retrying"
    history = _scan(db, schema)
    assert rl.delete_run(parent)  # a tombstone: its child lives
    assert rl.delete_run(child)
    assert rl.cancel(lapsed.id).changed
    assert _scan(db, schema) != history
    cancelled_at = rl.get_run(lapsed.id).finished_at
    assert cancelled_at is not None
    history[(_minute(cancelled_at), "stats.flaky")]["cancelled"] += 1  # history goes on
    moved.advance(60)
    rl.run_maintenance_once()  # the first fold
    _assert_rollup_is(rl, since, history)
    departed = sql.SQL("select count(*) from {}.stats_departed").format(sql.Identifier(schema))
    assert db.execute(departed).fetchone() == (6,)  # 2 triggers, a start, 2 finishes, a retry
    for _ in range(2):  # the second fold, then one past it: the minute is final
        moved.advance(60)
        rl.run_maintenance_once()
    _assert_rollup_is(rl, since, history)
    assert db.execute(departed).fetchone() == (0,)


@pytest.mark.parametrize("job", ["producer", "worker", "operator", "maintenance"])
def test_only_the_operators_functions_write_departed_figures_and_only_the_fold_reads_them(
    job: str, schema: str, granted: Any, db: Conn, make_runlane: RunlaneFactory
) -> None:
    """stats_departed (migration 25) is written by runlane_retry_runs, runlane_cancel_runs
    and runlane_delete_runs alone; the maintenance job reads it and deletes what is final."""
    make_runlane(tasks=TASKS)  # the schema, migrated
    conninfo = granted(job)
    row = (
        "insert into {schema}.stats_departed (environment, at, queue, task_id, triggered) "
        "values ('default', now(), 'default', 'stats.work', 1000)"
    )
    table = sql.Identifier(schema)
    db.execute(sql.SQL(row).format(schema=table))
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for statement in (row, "update {schema}.stats_departed set triggered = 7"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(sql.SQL(statement).format(schema=table))
        read = sql.SQL("select triggered from {schema}.stats_departed").format(schema=table)
        delete = sql.SQL("delete from {schema}.stats_departed").format(schema=table)
        if job == "maintenance":
            assert conn.execute(read).fetchall() == [(1000,)]
            assert conn.execute(delete).rowcount == 1
        else:
            for refused in (read, delete):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(refused)


def test_two_retries_of_one_run_at_once_retry_it_and_record_its_finish_once(
    make_runlane: RunlaneFactory, database_url: str, db: Conn, schema: str
) -> None:
    """The second of two concurrent retries waited for the first's row lock, then saw the
    run as its statement's snapshot had it (failed): it queued the run again and recorded
    its finish a second time (two operators, a double click). It now reads the run as
    locked: not retried, nothing recorded."""
    rl = make_runlane(tasks=[doomed])
    run_id = rl.trigger(doomed, {}).id
    rl.drain()
    assert rl.get_run(run_id).status is RunStatus.FAILED
    retry = sql.SQL("select retried from {}.runlane_retry_runs('default', %s, false)").format(
        sql.Identifier(schema)
    )
    first = psycopg.connect(database_url)
    answers: queue.Queue[Any] = queue.Queue()

    def second() -> None:
        with psycopg.connect(database_url, autocommit=True) as conn:
            answers.put(conn.execute(retry, ([run_id],)).fetchone())

    try:
        assert first.execute(retry, ([run_id],)).fetchone() == (True,)  # holds the lock
        waiter = threading.Thread(target=second, name="test-second-retry")
        waiter.start()
        blocked = sql.SQL(
            "select count(*) from pg_stat_activity where wait_event_type = 'Lock' and query like %s"
        )
        waiting = ("%runlane_retry_runs%",)
        assert poll(lambda: db.execute(blocked, waiting).fetchone() == (1,), timeout=10)
        first.commit()
        waiter.join(10)
    finally:
        first.close()
    assert answers.get(timeout=1) == (False,)
    departed = sql.SQL("select status from {}.stats_departed").format(sql.Identifier(schema))
    assert db.execute(departed).fetchall() == [("failed",)]
