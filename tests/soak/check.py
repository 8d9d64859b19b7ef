"""The checks at the end of a soak: the database and the handlers' own records, compared.

Invariants (a break fails the soak, named): no run lost, none failed, none completed twice,
every completed run's output from its final attempt, no handler started on an attempt that
was already finalized, the bounded queue never above its limit, every step's side effect
once unless a fault interrupted it before the step's write, every run terminal.
"""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import datetime, timedelta
from typing import Any, LiteralString

import attrs
import psycopg
from psycopg import sql

from tests.soak.app import BOUNDED_QUEUE, STEP_NAME, Settings, uses_step
from tests.soak.faults import Event

TERMINAL = ("completed", "failed", "cancelled")
FAULTS = frozenset(
    {
        "sigkill-worker",
        "zombie",
        "terminate-storm",
        "postgres-restart",
        "proxy-stall",
        "maintenance-failover",
    }
)


@attrs.define
class Report:
    figures: dict[str, Any] = attrs.field(factory=dict)
    violations: list[tuple[str, str]] = attrs.field(factory=list)

    def fail(self, invariant: str, detail: str) -> None:
        self.violations.append((invariant, detail))


class Reader:
    def __init__(self, conn: psycopg.Connection[Any], settings: Settings) -> None:
        self.conn = conn
        self.settings = settings

    def all(self, text: LiteralString, *params: Any) -> list[tuple[Any, ...]]:
        query = sql.SQL(text).format(
            schema=sql.Identifier(self.settings.schema), side=sql.Identifier(self.settings.side)
        )
        return self.conn.execute(query, params).fetchall()

    def one(self, text: LiteralString, *params: Any) -> Any:
        return self.all(text, *params)[0][0]


def _sample(rows: list[Any], n: int = 5) -> str:
    return ", ".join(str(r) for r in rows[:n]) + (" ..." if len(rows) > n else "")


def check(
    conn: psycopg.Connection[Any],
    settings: Settings,
    *,
    deaths: dict[str, datetime],
    freezes: dict[str, list[tuple[datetime, datetime]]],
    frozen_mono: dict[str, list[tuple[float, float]]],
    events: list[Event],
    ended: datetime,
    mono_offset: float,
) -> Report:
    """``mono_offset``: database epoch seconds minus ``time.monotonic()`` (system-wide), to
    place the handlers' monotonic records on the database's clock."""
    db = Reader(conn, settings)
    report = Report()
    f = report.figures

    # -- runs: lost, terminal, failed --------------------------------------------------------
    triggered = db.one("select count(*) from {side}.triggered")
    runs = db.one("select count(*) from {schema}.runs")
    f["runs triggered"] = triggered
    f["runs in the database"] = runs
    if triggered != settings.runs:
        report.fail("runs lost", f"the producer confirmed {triggered} of {settings.runs} runs")
    lost = db.all(
        "select t.i, t.run_id from {side}.triggered t "
        "left join {schema}.runs r on r.id = t.run_id where r.id is null order by t.i"
    )
    f["runs lost"] = len(lost)
    if lost:
        report.fail("runs lost", f"{len(lost)} triggered runs are not stored: {_sample(lost)}")
    if runs != settings.runs:
        report.fail("runs lost", f"{runs} runs stored for {settings.runs} triggered (keys)")
    statuses = dict(db.all("select status, count(*) from {schema}.runs group by status"))
    f["statuses"] = statuses
    open_runs = db.all(
        "select id, status, attempt from {schema}.runs where status <> all(%s) limit 20",
        list(TERMINAL),
    )
    if open_runs:
        report.fail(
            "every run terminal",
            f"{sum(v for k, v in statuses.items() if k not in TERMINAL)} not terminal: "
            f"{_sample(open_runs)}",
        )
    failed = db.all(
        "select id, attempt, max_attempts, error->>'type', left(error->>'message', 120) "
        "from {schema}.runs where status in ('failed', 'cancelled')"
    )
    f["failed for lack of attempts"] = sum(1 for r in failed if r[1] >= r[2])
    f["failed or cancelled (any reason)"] = len(failed)
    if failed:
        report.fail(
            "no run failed", f"{len(failed)} runs failed or were cancelled: {_sample(failed)}"
        )
    attempts = db.all("select max(attempt), avg(attempt)::float, max(releases) from {schema}.runs")[
        0
    ]
    f["attempts per run (max / mean), releases max"] = (
        attempts[0],
        round(attempts[1] or 0.0, 3),
        attempts[2],
    )
    f["attempt budget per run"] = db.one("select max(max_attempts) from {schema}.runs")

    # -- completions ------------------------------------------------------------------------
    doubles = db.all(
        "select run_id, count(*) from {schema}.attempts where outcome = 'completed' "
        "group by run_id having count(*) > 1"
    )
    f["double completions"] = len(doubles)
    if doubles:
        report.fail("no double completion", f"{len(doubles)} runs: {_sample(doubles)}")
    stale = db.all(
        "select r.id, r.attempt, r.output->>'attempt', r.output->>'lease', a.lease_token, "
        "a.outcome from {schema}.runs r left join {schema}.attempts a "
        "on a.run_id = r.id and a.attempt = r.attempt where r.status = 'completed' and ("
        "a.run_id is null or a.outcome <> 'completed' "
        "or (r.output->>'attempt')::int <> r.attempt "
        "or (r.output->>'lease')::uuid <> a.lease_token)"
    )
    f["stale writes applied"] = len(stale)
    if stale:
        report.fail(
            "no stale write applied",
            f"{len(stale)} completed runs whose output is not their final attempt's: "
            f"{_sample(stale)}",
        )
    no_record = db.all(
        "select r.id from {schema}.runs r where r.status = 'completed' and not exists ("
        "select 1 from {side}.executions e where e.run_id = r.id "
        "and e.lease = (r.output->>'lease')::uuid and e.error is null "
        "and e.ended_at is not null)"
    )
    if no_record:
        report.fail(
            "no stale write applied",
            f"{len(no_record)} completed runs whose output no cleanly ended handler returned: "
            f"{_sample(no_record)}",
        )

    # -- handler executions ------------------------------------------------------------------
    per_run = Counter(
        int(n)
        for (n,) in db.all(
            "select count(e.id) from {schema}.runs r "
            "left join {side}.executions e on e.run_id = r.id group by r.id"
        )
    )
    f["handler executions per run (executions: runs)"] = dict(sorted(per_run.items()))
    total = sum(k * v for k, v in per_run.items())
    f["handler executions (total, per run)"] = (total, round(total / max(1, runs), 4))
    late_rows = db.all(
        "select e.run_id, e.attempt, e.proc, a.outcome, "
        "extract(epoch from e.started_at - a.finished_at)::float, "
        "a.started_at::text, a.finished_at::text, e.started_at::text, e.checked, "
        "extract(epoch from a.finished_at)::float "
        "from {side}.executions e join {schema}.attempts a on a.run_id = e.run_id "
        "and a.attempt = e.attempt and a.lease_token = e.lease "
        "where e.started_at > a.finished_at order by e.started_at"
    )
    # the record is written by the handler's first statement: a pause or an outage between
    # the worker's lease check and that statement delays it. What counts is when the worker
    # checked the lease and started the attempt, on the database's clock (10 ms of slack
    # for the offset's measurement)
    late = [r[:-2] for r in late_rows if r[-2] + mono_offset > r[-1] + 0.01]
    # the mapping itself, checked: a handler's record follows the worker's lease check by
    # a few milliseconds (the record's round trip) in the usual case
    lag = db.one(
        "select percentile_cont(0.5) within group (order by "
        "extract(epoch from started_at)::float - (checked + %s)) from {side}.executions",
        mono_offset,
    )
    f["lease check to handler record, median (ms)"] = round(1000 * float(lag or 0.0), 2)
    if lag is None or not 0.0 <= float(lag) < 0.5:
        report.fail(
            "the handlers' monotonic records map onto the database clock",
            f"median lag from lease check to record {lag!r} s (expected 0 to 0.5 s)",
        )
    f["handlers started on an already-finalized attempt"] = len(late)
    f["handlers started on a live lease that recorded their start after it ended"] = len(
        late_rows
    ) - len(late)
    if late:
        report.fail(
            "no handler started on an expired claim",
            f"{len(late)} handlers started after their attempt was finalized "
            f"(run, attempt, proc, outcome, seconds late, attempt started, attempt finalized, "
            f"handler started): {_sample(late)}",
        )
    unknown = db.one(
        "select count(*) from {side}.executions e where not exists (select 1 from "
        "{schema}.attempts a where a.run_id = e.run_id and a.lease_token = e.lease) "
        "and not exists (select 1 from {schema}.runs r where r.lease_token = e.lease)"
    )
    f["handlers under a lease no attempt recorded"] = unknown
    errors = dict(
        db.all(
            "select split_part(coalesce(error, 'killed or frozen (no end)'), ':', 1), count(*) "
            "from {side}.executions where error is not null or ended_at is null group by 1"
        )
    )
    f["handler executions that did not return (by cause)"] = errors

    # -- the bounded queue -------------------------------------------------------------------
    strict, through = _overlap(
        db.all(
            # with the moment its lease lapsed, when maintenance found the attempt expired
            # (its error names it): from then on the slot is free for the next claim
            "select e.proc, e.started_at, e.ended_at, e.entered,"
            " substring(a.error->>'message' from 'expired at ([^)]+)\\)')::timestamptz"
            " from {side}.executions as e left join {schema}.attempts as a"
            " on a.run_id = e.run_id and a.attempt = e.attempt and a.outcome = 'expired'"
            " where e.queue = %s",
            BOUNDED_QUEUE,
        ),
        deaths,
        freezes,
        frozen_mono,
        ended,
        outages=_lease_ending_outages(events, timedelta(seconds=settings.lease)),
    )
    f["bounded queue limit"] = settings.bounded_limit
    f["bounded queue max handlers at once"] = strict
    f["bounded queue max at once counting handlers resumed from a freeze"] = through
    if strict > settings.bounded_limit:
        report.fail(
            "bounded queue within its limit",
            f"{strict} handlers of {BOUNDED_QUEUE!r} executed at once (limit "
            f"{settings.bounded_limit})",
        )

    # -- steps ------------------------------------------------------------------------------
    _check_steps(db, report, freezes)

    # -- faults and recovery -----------------------------------------------------------------
    _recovery(db, report, events, deaths)
    _faults_and_calls(db, report, events)
    notes = {k: int(v) for k, v in db.all("select key, value from {side}.notes")}
    f["trigger calls that raised (repeated with the same keys)"] = notes.get("trigger_errors", 0)
    f["get_run calls that raised (of all made)"] = (
        notes.get("get_run_errors", 0),
        notes.get("get_run_errors", 0) + notes.get("get_run_calls", 0),
    )
    f["process clocks against the database (s)"] = {
        proc.rsplit(".", 1)[0]: round(float(skew))
        for proc, skew in db.all("select proc, skew from {side}.procs order by started_at")
        if abs(float(skew)) > 60
    }
    return report


Lapse = tuple[datetime, str | None]  # (when every lease had lapsed, the process or None: all)


def _lease_ending_outages(events: list[Event], lease: timedelta) -> list[Lapse]:
    """Outages at least as long as a lease, as (their start plus one lease, the process or
    None for every process). No lease can be extended through one, so every lease held
    when it began has lapsed by its start plus one lease: a handler still running after that
    (blocked in a retried statement, say) is a zombie that holds no slot of its bounded
    queue. A Postgres restart stops every process's extensions; a proxy stall only the
    stalled worker's."""
    outages: list[Lapse] = []
    for event in events:
        if event.until is None or event.until - event.at < lease:
            continue
        if event.kind == "postgres-restart":
            outages.append((event.at + lease, None))
        elif event.kind == "proxy-stall":
            outages.append((event.at + lease, event.detail.get("proc")))
    return outages


def _overlap(
    rows: list[tuple[Any, ...]],
    deaths: dict[str, datetime],
    freezes: dict[str, list[tuple[datetime, datetime]]],
    frozen_mono: dict[str, list[tuple[float, float]]],
    ended: datetime,
    *,
    outages: list[Lapse],
) -> tuple[int, int]:
    """The most handlers executing at once: strictly (a handler frozen with its process stops
    counting at the freeze, one blocked through an outage longer than a lease at the lease's
    end: see _lease_ending_outages; one whose attempt maintenance found expired, when its
    lease lapsed, a row's optional fifth field) and counting handlers that resumed after a
    freeze."""
    strict: list[tuple[datetime, int]] = []
    through: list[tuple[datetime, int]] = []
    for proc, start, end, entered, *lapse in rows:
        stop = end if end is not None else deaths.get(proc, ended)
        through += [(start, 1), (stop, -1)]
        if _entered_before_freeze(proc, entered, frozen_mono) and any(
            start >= frozen for frozen, _ in freezes.get(proc, [])
        ):
            continue  # entered before the freeze, recorded after: it ran through it
        # it stops holding its slot at the first freeze of its process, or lease-ending
        # outage, after it started
        ends = [frozen for frozen, _resumed in freezes.get(proc, [])]
        ends += [lapsed for lapsed, only in outages if only in (None, proc)]
        ends += [lapsed for lapsed in lapse if lapsed is not None]
        cut = min((t for t in ends if start <= t < stop), default=stop)
        strict += [(start, 1), (cut, -1)]
    return _peak(strict), _peak(through)


def _entered_before_freeze(
    proc: str, entered: float, frozen_mono: dict[str, list[tuple[float, float]]]
) -> bool:
    """The handler function was entered before a freeze of its process began."""
    return any(entered < stopped for stopped, _ in frozen_mono.get(proc, []))


def _peak(points: list[tuple[datetime, int]]) -> int:
    level = peak = 0
    for _, delta in sorted(points):  # at one instant, ends (-1) sort before starts (+1)
        level += delta
        peak = max(peak, level)
    return peak


def _check_steps(
    db: Reader, report: Report, freezes: dict[str, list[tuple[datetime, datetime]]]
) -> None:
    f = report.figures
    stored = dict(db.all("select run_id, output from {schema}.steps where name = %s", STEP_NAME))
    runs = db.all(
        "select t.i, r.id, r.status from {side}.triggered t join {schema}.runs r on r.id = t.run_id"
    )
    effects: dict[uuid.UUID, list[tuple[Any, ...]]] = {}
    for row in db.all(
        "select f.run_id, f.id, f.attempt, f.proc, e.ended_at, e.error from {side}.effects f "
        "left join {side}.executions e on e.run_id = f.run_id and e.lease = f.lease "
        "and e.proc = f.proc where f.step = %s",
        STEP_NAME,
    ):
        effects.setdefault(row[0], []).append(row)
    missing = []
    once = interrupted = 0
    repeated = []
    for i, run_id, status in runs:
        if not uses_step(i):
            continue
        done = effects.get(run_id, [])
        if status == "completed" and run_id not in stored:
            missing.append(run_id)
            continue
        winner = stored.get(run_id)
        if len(done) == 1:
            once += 1
        for _, effect_id, attempt, proc, ended_at, error in done:
            if effect_id == winner:
                continue
            frozen = bool(freezes.get(proc))
            if ended_at is None or error is not None or frozen:
                interrupted += 1  # the fault came between the side effect and the step write
            else:
                repeated.append((run_id, effect_id, attempt, proc))
    f["step side effects (once, repeated after an interruption before the step write)"] = (
        once,
        interrupted,
    )
    if missing:
        report.fail(
            "each step's side effect once",
            f"{len(missing)} completed runs have no stored step: {_sample(missing)}",
        )
    if repeated:
        report.fail(
            "each step's side effect once",
            f"{len(repeated)} side effects repeated by a handler that was not interrupted: "
            f"{_sample(repeated)}",
        )
    unmatched = [
        run_id
        for run_id, out in stored.items()
        if run_id not in effects or out not in {e[1] for e in effects[run_id]}
    ]
    if unmatched:
        report.fail(
            "each step's side effect once",
            f"{len(unmatched)} stored steps name no side effect: {_sample(unmatched)}",
        )


def _recovery(db: Reader, report: Report, events: list[Event], deaths: dict[str, datetime]) -> None:
    """Seconds from the end of each outage until work flowed again."""
    f = report.figures
    restarts = []
    for event in events:
        if event.kind != "postgres-restart" or event.until is None:
            continue
        first = db.one(
            "select min(finished_at) from {schema}.attempts where outcome = 'completed' "
            "and finished_at > %s",
            event.until,
        )
        # every worker process running before the restart and not killed before it ran a
        # handler again: when did it run one?
        resumed = db.all(
            "select proc, min(started_at) filter (where started_at > %s) "
            "from {side}.executions where proc in (select proc from {side}.executions "
            "where started_at < %s) group by proc",
            event.until,
            event.at,
        )
        back: list[float] = []
        never: list[str] = []
        for proc, first_start in resumed:
            died = deaths.get(proc)
            if first_start is None:
                if died is None:  # alive, yet no handler since: idle, stalled or stuck
                    never.append(proc)
                continue
            back.append((first_start - event.until).total_seconds())
        all_back = max(back, default=None)
        restarts.append(
            {
                "down (s)": round((event.until - event.at).total_seconds(), 2),
                **({"long outage": True} if event.detail.get("long") else {}),
                **(
                    {"started while down": event.detail["started while down"]}
                    if event.detail.get("started while down")
                    else {}
                ),
                "first completion after (s)": _seconds(first, event.until),
                "every worker running handlers after (s)": _round(all_back),
                "workers without a handler since": never,
            }
        )
    f["postgres restarts"] = restarts
    for event in events:
        if event.kind == "proxy-stall" and event.until is not None:
            proc = event.detail["proc"]
            first = db.one(
                "select min(started_at) from {side}.executions where proc like %s "
                "and started_at > %s",
                proc.rsplit(".", 1)[0] + ".%",
                event.until,
            )
            f["proxy stall"] = {
                "stalled (s)": round((event.until - event.at).total_seconds(), 2),
                "proxied worker running handlers again after (s)": _seconds(first, event.until),
            }
        if event.kind == "maintenance-failover":
            takeover = event.detail.get("takeover", {})
            f["maintenance failover"] = {
                "killed": event.detail["proc"],
                "bands taken over (s after the kill)": {
                    k: round(v, 2) for k, v in takeover.items()
                },
            }
            if len(takeover) < len(event.detail.get("bands", [])):
                report.fail(
                    "maintenance failover",
                    f"bands {event.detail['bands']} of the killed replica were not all taken "
                    f"over: {takeover}",
                )
        if event.kind == "zombie" and event.until is not None:
            f["zombie"] = {
                "frozen (s)": round((event.until - event.at).total_seconds(), 2),
                **event.detail,
            }
    storms = [e.detail.get("backends", 0) for e in events if e.kind == "terminate-storm"]
    f["backends terminated by the storms"] = storms


def _faults_and_calls(db: Reader, report: Report, events: list[Event]) -> None:
    """Every fault of the schedule was injected; no application call failed while up."""
    f = report.figures
    counts = Counter(e.kind for e in events)
    f["faults injected"] = dict(counts)
    missing = sorted(FAULTS - set(counts))
    if missing or counts["postgres-restart"] < 3:
        report.fail("every fault injected", f"missing: {missing}; injected: {dict(counts)}")
    # application calls (trigger_many, get_run) that raised: during an outage (a restart
    # window, half a second of grace) they may; while Postgres is up they must not
    outages = [
        (e.at, e.until + timedelta(seconds=0.5))
        for e in events
        if e.kind == "postgres-restart" and e.until is not None
    ]
    up: list[tuple[Any, ...]] = []
    during = 0
    for at, call, error in db.all("select at, call, error from {side}.api_errors order by at"):
        if any(start <= at <= end for start, end in outages):
            during += 1
        else:
            up.append((at.isoformat(timespec="milliseconds"), call, error[:160]))
    f["application calls that raised (during an outage, while Postgres was up)"] = (
        during,
        len(up),
    )
    if up:
        report.fail(
            "no application call failed while Postgres was up",
            f"{len(up)} calls raised: {_sample(up, 3)}",
        )


def _seconds(value: datetime | None, since: datetime) -> float | None:
    return None if value is None else round((value - since).total_seconds(), 2)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
