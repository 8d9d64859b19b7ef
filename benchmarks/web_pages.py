"""The web console's server time per page with 1,000,000 runs stored (issue 21: every page
within 200 ms; issue 39: the charts over time and /metrics too, with a week of rollup).

    python -m benchmarks.web_pages [--runs 1000000] [--last-hour 60000] [--queued 20000]
                                   [--rollup-days 7] [--repeat 20] [--database-url URL]

``--runs`` runs are inserted in SQL (generate_series, every index in place, then analysed)
in environment ``default``: ``--queued`` queued runs over four queues, 5,000 retrying, 5,000
waiting (sleeps), 3% failed (with an error and a traceback, one attempt each), the rest
completed; ``--last-hour`` of the terminal runs finished in the last hour (the chart's
hour), the others over the week before. One parent has 500 children. The rollup
(``stats_rollup``) holds ``--rollup-days`` of every minute for each of the 20 tasks in its
queue (as the runs are spread: 201,600 one-minute rows for a week, and the 15- and 60-minute
spans' rows), each row's histograms with five non-zero buckets. Each page is asked
``--repeat`` times through the WSGI app in this process (Flask's test client: the server's
time, without a network or a browser) after three warm-up requests; the table gives the
median, p95 and the slowest.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from typing import Any
from urllib.parse import quote

import psycopg

from benchmarks._bulk import chunks
from benchmarks._common import Row, add_database_argument, fresh_schema, log, pct, server_url
from runlane import create_runlane
from runlane.postgres import postgres_polling_lane
from runlane.stats import HISTOGRAM_BOUNDS
from runlane.web import create_app

QUEUES = ("default", "mail", "reports", "billing")
# a payload search whose one match is among the oldest runs: the search spends its budget
SEARCH_PAYLOAD = "/runs?payload=" + quote('{"n": 5}')
LIMIT_MS = 200.0


def fill(url: str, schema: str, args: argparse.Namespace) -> tuple[uuid.UUID, uuid.UUID]:
    """The runs; returns (a failed run, the parent of 500 children)."""
    began = time.perf_counter()
    live = args.queued + 10_000
    terminal = args.runs - live
    parent = uuid.uuid4()
    with psycopg.connect(url, autocommit=True) as conn:
        for start, end in chunks(terminal):
            # every 33rd run failed; the first --last-hour finished in the last hour
            conn.execute(
                f"""
                insert into {schema}.runs (
                    id, environment, task_id, queue, status, priority, payload, output, error,
                    attempt, max_attempts, due_at, created_at, updated_at, started_at,
                    finished_at, parent_run_id)
                select gen_random_uuid(), 'default', 'bench.task' || (g %% 20), q.name, st,
                       0, jsonb_build_object('n', g, 'note', repeat('x', 80)),
                       case when st = 'completed' then '{{"ok": true}}'::jsonb end,
                       case when st = 'failed' then jsonb_build_object(
                           'type', 'RuntimeError', 'message', 'upstream down',
                           'traceback', repeat('  File "app.py", line 1, in handler' || chr(10),
                                               20)) end,
                       1, 3, ts, ts, ts + interval '50 ms', ts, ts + interval '50 ms',
                       case when g < 500 then %(parent)s::uuid end
                from (
                    select g,
                           case when g %% 33 = 0 then 'failed' else 'completed' end as st,
                           case when g < %(last_hour)s
                                then now() - (g::float8 / %(last_hour)s) * interval '59 minutes'
                                else now() - interval '1 hour'
                                     - (g::float8 / %(total)s) * interval '7 days' end as ts
                    from generate_series(%(start)s::bigint, %(end)s::bigint - 1) as g
                ) as s
                cross join lateral (
                    select (array['default', 'mail', 'reports', 'billing'])[1 + g %% 4] as name
                ) as q
                """,
                {
                    "start": start,
                    "end": end,
                    "total": terminal,
                    "last_hour": args.last_hour,
                    "parent": parent,
                },
            )
            log(f"terminal runs: {end:,} of {terminal:,} ({time.perf_counter() - began:.0f} s)")
        conn.execute(
            f"""
            insert into {schema}.runs (
                id, environment, task_id, queue, status, priority, payload, attempt,
                max_attempts, due_at, created_at, updated_at, wait_kind)
            select gen_random_uuid(), 'default', 'bench.task' || (g %% 20),
                   (array['default', 'mail', 'reports', 'billing'])[1 + g %% 4],
                   s.status, 0, '{{"live": true}}'::jsonb, s.attempt, 3,
                   now() + s.later, now() - (g::float8 / %(live)s) * interval '1 hour', now(),
                   s.wait_kind
            from generate_series(0, %(live)s - 1) as g
            cross join lateral (
                select case when g < %(queued)s then 'queued'
                            when g < %(queued)s + 5000 then 'retrying'
                            else 'waiting' end as status,
                       case when g < %(queued)s then 0 else 1 end as attempt,
                       case when g < %(queued)s then interval '0' else interval '1 hour' end
                           as later,
                       case when g >= %(queued)s + 5000 then 'sleep' end as wait_kind
            ) as s
            """,
            {"live": live, "queued": args.queued},
        )
        conn.execute(
            f"""
            insert into {schema}.runs (
                id, environment, task_id, queue, status, payload, attempt, max_attempts,
                due_at, created_at, updated_at, started_at, finished_at, output)
            values (%(parent)s, 'default', 'bench.parent', 'default', 'completed', '{{}}',
                    1, 3, now(), now() - interval '2 days', now(), now() - interval '2 days',
                    now() - interval '2 days', '{{}}')
            """,
            {"parent": parent},
        )
        failed = conn.execute(
            f"select id from {schema}.runs where status = 'failed' order by created_at desc limit 1"
        ).fetchone()
        assert failed is not None
        conn.execute(
            f"""
            insert into {schema}.attempts (run_id, attempt, lease_token, outcome, error,
                                           started_at, finished_at)
            select id, 1, gen_random_uuid(), 'failed', error, started_at, finished_at
            from {schema}.runs where id = %(id)s
            """,
            {"id": failed[0]},
        )
        conn.execute(f"analyze {schema}.runs")
        conn.execute(f"vacuum {schema}.runs")
    log(f"{args.runs:,} runs in {time.perf_counter() - began:.0f} s")
    return failed[0], parent


def fill_rollup(url: str, schema: str, days: int) -> None:
    """``days`` of the rollup, every minute, each task in its queue: each span's rows, as the
    fold keeps them (a 15-minute row holds 15 minutes' figures)."""
    began = time.perf_counter()
    size = len(HISTOGRAM_BOUNDS) + 1
    with psycopg.connect(url, autocommit=True) as conn:
        for span in (1, 15, 60):
            counts = "{" + ",".join(str(2 * span) if 18 <= i < 23 else "0" for i in range(size))
            conn.execute(
                f"""
                insert into {schema}.stats_rollup (
                    environment, span, minute, queue, task_id, triggered, started, retried,
                    completed, failed, cancelled, wait_counts, wait_sum, run_counts, run_sum)
                select 'default', %(span)s, m,
                       (array['default', 'mail', 'reports', 'billing'])[1 + t %% 4],
                       'bench.task' || t, 10 * %(span)s, 10 * %(span)s, %(span)s,
                       9 * %(span)s, %(span)s, 0, %(counts)s::integer[], 4.2 * %(span)s,
                       %(counts)s::integer[], 4.2 * %(span)s
                from generate_series(
                         date_bin(%(span)s * interval '1 minute', now(), timestamptz 'epoch')
                             - %(days)s * interval '1 day',
                         now() - %(span)s * interval '1 minute',
                         %(span)s * interval '1 minute') as m,
                     generate_series(0, 19) as t
                """,
                {"counts": counts + "}", "span": span, "days": days},
            )
        conn.execute(f"analyze {schema}.stats_rollup")
    log(f"{days} days of rollup in {time.perf_counter() - began:.0f} s")


def measure(url: str, args: argparse.Namespace) -> list[Row]:
    schema = fresh_schema(url)
    failed, parent = fill(url, schema, args)
    fill_rollup(url, schema, args.rollup_days)
    lane = postgres_polling_lane(connection_string=url, schema=schema)
    rows: list[Row] = []
    with create_runlane(lane=lane) as runlane:
        client = create_app(runlane, authorize=lambda request, action: True).test_client()
        second = client.get("/runs?status=completed").get_data(as_text=True)
        cursor = second.split("cursor=", 1)[1].split('"', 1)[0].replace("&amp;", "&")
        pages = {
            "overview /": "/",
            "runs /runs": "/runs",
            "runs, page 2": f"/runs?status=completed&cursor={cursor}",
            "runs ?status=failed": "/runs?status=failed",
            "runs ?queue=mail": "/runs?queue=mail",
            "runs ?task=bench.task7": "/runs?task=bench.task7",
            "runs ?created_before=3 days ago": "/runs?created_before="
            + time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() - 3 * 86400)),
            "run (failed, traceback)": f"/runs/{failed}",
            "run (500 children)": f"/runs/{parent}",
            "queues": "/queues",
            "workers": "/workers",
            "schedules": "/schedules",
            "bulk retry ?status=failed (count)": "/runs/bulk?action=retry&status=failed",
            "bulk cancel ?queue=mail (count)": "/runs/bulk?action=cancel&queue=mail",
            # issue 39's searches, without the optional indexes: windows within the budget
            "search ?task_prefix=bench.task1": "/runs?task_prefix=bench.task1",
            "search ?task_prefix=bench.task19 (rare)": "/runs?task_prefix=bench.task19",
            "search ?queue_prefix=mai": "/runs?queue_prefix=mai",
            "search ?idempotency_key (no match: budget)": "/runs?idempotency_key=none-such",
            "search ?payload={n: 5} (oldest: budget)": SEARCH_PAYLOAD,
            "search ?payload, status=failed": "/runs?status=failed&payload=" + quote('{"n": 33}'),
            "/metrics": "/metrics",
            "charts 1h": "/charts",
            "charts 24h": "/charts?range=24h",
            "charts 7d": "/charts?range=7d",
            "charts 7d ?queue=mail": "/charts?queue=mail&range=7d",
            "charts 7d ?task=bench.task7": "/charts?task=bench.task7&range=7d",
        }
        rows += [timed(client, label, path, args.repeat) for label, path in pages.items()]
        # the optional indexes docs/console.md names, and the searches they serve
        began = time.perf_counter()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                f"create index runs_payload_search on {schema}.runs using gin (payload "
                "jsonb_path_ops)"
            )
            conn.execute(
                f"create index runs_key_search on {schema}.runs (environment, idempotency_key) "
                "where idempotency_key is not null"
            )
        log(f"the two search indexes in {time.perf_counter() - began:.0f} s")
        rows.append(
            timed(
                client, "search ?payload={n: 5}, runs_payload_search", SEARCH_PAYLOAD, args.repeat
            )
        )
        rows.append(
            timed(
                client,
                "search ?idempotency_key, runs_key_search",
                "/runs?idempotency_key=none-such",
                args.repeat,
            )
        )
    return rows


def timed(client: Any, label: str, path: str, repeat: int) -> Row:
    """``path``'s server time: three warm-ups, then ``repeat`` requests."""
    for _ in range(3):
        answer = client.get(path)
        assert answer.status_code == 200, (path, answer.status_code)
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        answer = client.get(path)
        times.append((time.perf_counter() - began) * 1000)
        assert answer.status_code == 200
    slowest = max(times)
    log(f"{label}: median {statistics.median(times):.1f} ms, max {slowest:.1f} ms")
    return Row(
        label,
        statistics.median(times),
        ",.1f",
        "p95",
        pct(times, 0.95),
        slowest,
        f"< {LIMIT_MS:.0f} ms",
        slowest < LIMIT_MS,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--last-hour", type=int, default=60_000)
    parser.add_argument("--queued", type=int, default=20_000)
    parser.add_argument("--rollup-days", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=20)
    add_database_argument(parser)
    args = parser.parse_args(argv)
    with server_url(args.database_url) as url:
        rows = measure(url, args)
    print("| page | median ms | p95 ms | max ms | target | met |")
    print("|---|---:|---:|---:|---|---|")
    for row in rows:
        met = "met" if row.met else "NOT MET"
        print(
            f"| {row.measure} | {row.value:.1f} | {row.floor:.1f} | {row.ratio:.1f} | "
            f"{row.target} | {met} |"
        )
    return 0 if all(row.met for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
