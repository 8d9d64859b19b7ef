"""Bulk rows straight into runlane's tables, shaped as runlane itself leaves them.

``queued``: runs as ``trigger`` writes them (run_insert_many in sql/runs.sql): status
queued, attempt 0, no lease, due when created, payload ``null``, max_attempts 3 (the default
retry policy), a UUIDv7 id made from the creation time.

``finished``: runs as a no-op attempt leaves them after its claim (run_claim in
sql/claims.sql) and its completion (run_complete_many in sql/lifecycle.sql): status
completed, attempt 1, output ``null``, lease cleared, started/attempt_started/finished/
updated times set; plus the attempt row the completion inserts (attempt 1, the lease token,
outcome completed, started_at and finished_at).

Rows are inserted with every index and the statement triggers in place (as a live system
grows its tables), in chunks, and the tables are analysed afterwards (what autovacuum does
after a bulk load); the benchmark starts measuring after that.
"""

from __future__ import annotations

import time

import psycopg

from benchmarks._common import log

__all__ = ["chunks", "insert_finished", "insert_queued"]

CHUNK = 250_000

# A UUIDv7 from the timestamp "ts" and the series number "g": 48-bit Unix milliseconds, the
# version, a 12-bit counter (g mod 4096), the variant and 62 random bits (as runlane._ids).
_UUID7 = (
    "(lpad(to_hex((extract(epoch from ts) * 1000)::bigint), 12, '0') || '7' "
    "|| lpad(to_hex(g %% 4096), 3, '0') || to_hex(8 + g %% 4) "
    "|| lpad(to_hex((random() * 1152921504606846975::float8)::bigint), 15, '0'))::uuid"
)


def chunks(total: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each chunk of ``CHUNK`` rows of ``total`` (the last one shorter)."""
    return [(start, min(total, start + CHUNK)) for start in range(0, total, CHUNK)]


def _analyze(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> None:
    conn.execute(f"analyze {schema}.runs")
    conn.execute(f"analyze {schema}.attempts")


def insert_queued(
    url: str, schema: str, count: int, *, task_id: str = "bench.noop", queue: str = "default"
) -> float:
    """``count`` queued runs created over the last hour, oldest first; returns seconds."""
    began = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        for start, end in chunks(count):
            conn.execute(
                f"""
                insert into {schema}.runs (
                    id, environment, task_id, queue, status, priority, payload, attempt,
                    releases, max_attempts, due_at, created_at, updated_at)
                select {_UUID7}, 'default', %(task)s, %(queue)s, 'queued', 0, 'null'::jsonb,
                       0, 0, 3, ts, ts, ts
                from (select g, now() - interval '1 hour'
                                + (g::float8 / %(total)s) * interval '59 minutes' as ts
                      from generate_series(%(start)s::bigint, %(end)s::bigint - 1) as g) as s
                """,
                {"task": task_id, "queue": queue, "total": count, "start": start, "end": end},
            )
            log(f"queued runs: {end:,} of {count:,} ({time.perf_counter() - began:.0f} s)")
        _analyze(conn, schema)
    return time.perf_counter() - began


def insert_finished(
    url: str,
    schema: str,
    count: int,
    *,
    oldest_days: float,
    newest_days: float,
    task_id: str = "bench.noop",
    queue: str = "default",
) -> float:
    """``count`` completed runs (and their attempt rows) created evenly between
    ``oldest_days`` and ``newest_days`` ago, oldest first; returns seconds."""
    began = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        for start, end in chunks(count):
            conn.execute(
                f"""
                with made as (
                    insert into {schema}.runs (
                        id, environment, task_id, queue, status, priority, payload, output,
                        error, attempt, releases, max_attempts, due_at, lease_token,
                        lease_expires_at, attempt_started_at, created_at, updated_at,
                        started_at, finished_at)
                    select {_UUID7}, 'default', %(task)s, %(queue)s, 'completed', 0,
                           'null'::jsonb, 'null'::jsonb, null, 1, 0, 3, ts, null, null,
                           ts + interval '2 ms', ts, ts + interval '3 ms',
                           ts + interval '2 ms', ts + interval '3 ms'
                    from (select g, now() - %(oldest)s * interval '1 day'
                                    + (g::float8 / %(total)s)
                                      * (%(oldest)s - %(newest)s) * interval '1 day' as ts
                          from generate_series(%(start)s::bigint, %(end)s::bigint - 1) as g)
                        as s
                    returning id, attempt_started_at, finished_at
                )
                insert into {schema}.attempts (
                    run_id, attempt, lease_token, outcome, error, started_at, finished_at)
                select id, 1, gen_random_uuid(), 'completed', null, attempt_started_at,
                       finished_at
                from made
                """,
                {
                    "task": task_id,
                    "queue": queue,
                    "total": count,
                    "start": start,
                    "end": end,
                    "oldest": oldest_days,
                    "newest": newest_days,
                },
            )
            log(f"finished runs: {end:,} of {count:,} ({time.perf_counter() - began:.0f} s)")
        _analyze(conn, schema)
    return time.perf_counter() - began
