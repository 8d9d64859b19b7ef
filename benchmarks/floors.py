"""Plain-psycopg floors: what a Postgres queue must do at least, on tables of its own in the
same server and the same run as runlane's figures (no leases kept alive, no history, no
triggers, no validation; each statement commits durably, as runlane's writes do).

- ``insert_loop``: one autocommit ``INSERT`` per job over one connection (one round trip and
  one durable commit: what ``trigger`` must do at least), prepared, on a row of a run's width
  (UUIDv7 id, task, queue, status, priority, payload jsonb, due/created/updated times) with
  a primary key and one partial claim index;
- ``insert_unnest`` / ``insert_copy``: the same rows 1,000 per statement through
  ``INSERT ... SELECT FROM unnest(...)``, and through ``COPY``;
- ``claim_loop``: claim a batch with ``FOR UPDATE SKIP LOCKED`` (attempt + 1, a fresh lease
  token and expiry) and complete it with one ``UPDATE`` fenced by id, attempt and token, as
  ``../shared/peers/baseline_sql.py`` does; ``simple_claim_loop``: the older bare loop
  (claim ids, mark them done, no fencing) in one or more threads;
- ``wakeup``: trigger-to-claim with nothing else running: an autocommit ``INSERT`` that
  notifies in the same statement, a thread blocked in ``LISTEN`` that claims the row at once
  (``FOR UPDATE SKIP LOCKED``, asynchronous commit, as runlane's claims); the time from the
  insert's start to the claim's answer, per sample, after an idle pause.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import psycopg

from runlane._ids import new_run_id

__all__ = [
    "claim_loop",
    "insert_copy",
    "insert_loop",
    "insert_unnest",
    "simple_claim_loop",
    "wakeup",
]


def _table(conn: psycopg.Connection[tuple[object, ...]]) -> str:
    name = f"floor_{uuid.uuid4().hex[:8]}"
    conn.execute(
        f"create table {name} (id uuid primary key, task_id text not null, queue text not null, "
        "status text not null default 'queued', priority integer not null default 0, "
        "payload jsonb not null, due_at timestamptz not null default now(), "
        "created_at timestamptz not null default now(), "
        "updated_at timestamptz not null default now())"
    )
    conn.execute(f"create index on {name} (priority desc, due_at, id) where status = 'queued'")
    return name


def _payload(i: int) -> str:
    return json.dumps({"order": i})


def insert_loop(url: str, count: int) -> float:
    """Rows/s of ``count`` autocommit single-row INSERTs over one connection."""
    with psycopg.connect(url, autocommit=True) as conn:
        table = _table(conn)
        sql = f"insert into {table} (id, task_id, queue, payload) values (%s, %s, %s, %s)"
        started = time.perf_counter()
        for i in range(count):
            conn.execute(sql, (new_run_id(), "bench.noop", "default", _payload(i)), prepare=True)
        elapsed = time.perf_counter() - started
        conn.execute(f"drop table {table}")
    return count / elapsed


def insert_unnest(url: str, count: int, batch: int = 1000) -> float:
    """Rows/s of INSERT ... SELECT FROM unnest, ``batch`` rows per autocommit statement."""
    with psycopg.connect(url, autocommit=True) as conn:
        table = _table(conn)
        sql = (
            f"insert into {table} (id, task_id, queue, payload) "
            "select * from unnest(%s::uuid[], %s::text[], %s::text[], %s::jsonb[])"
        )
        started = time.perf_counter()
        for start in range(0, count, batch):
            k = min(batch, count - start)
            conn.execute(
                sql,
                (
                    [new_run_id() for _ in range(k)],
                    ["bench.noop"] * k,
                    ["default"] * k,
                    [_payload(start + i) for i in range(k)],
                ),
            )
        elapsed = time.perf_counter() - started
        conn.execute(f"drop table {table}")
    return count / elapsed


def insert_copy(url: str, count: int, batch: int = 1000) -> float:
    """Rows/s of COPY, ``batch`` rows per autocommit COPY."""
    with psycopg.connect(url, autocommit=True) as conn:
        table = _table(conn)
        started = time.perf_counter()
        with conn.cursor() as cur:
            for start in range(0, count, batch):
                with cur.copy(f"copy {table} (id, task_id, queue, payload) from stdin") as copy:
                    for i in range(start, min(count, start + batch)):
                        copy.write_row((new_run_id(), "bench.noop", "default", _payload(i)))
        elapsed = time.perf_counter() - started
        conn.execute(f"drop table {table}")
    return count / elapsed


def claim_loop(url: str, count: int, batch: int) -> float:
    """Jobs/s of one claim-batch / fenced-complete-batch loop over ``count`` queued rows."""
    table = f"floor_claim_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f"create table {table} (id bigint generated always as identity primary key, "
            "queue text not null, status text not null default 'queued', "
            "priority int not null default 0, available_at timestamptz not null default now(), "
            "attempt int not null default 0, lease_token uuid, lease_expires_at timestamptz, "
            "payload jsonb, output jsonb, finished_at timestamptz)"
        )
        conn.execute(
            f"create index on {table} (queue, priority, available_at, id) where status = 'queued'"
        )
        conn.execute(
            f"insert into {table} (queue, payload) "
            "select 'q', jsonb_build_object('i', g) from generate_series(1, %s) as g",
            (count,),
        )
        conn.execute(f"vacuum analyze {table}")
        claim = f"""
            with c as materialized (
                select id from {table}
                where status = 'queued' and queue = 'q' and available_at <= now()
                order by priority, available_at, id limit %s for update skip locked)
            update {table} as t set status = 'running', attempt = t.attempt + 1,
                lease_token = gen_random_uuid(), lease_expires_at = now() + interval '5 minutes'
            from c where t.id = c.id
            returning t.id, t.attempt, t.lease_token, t.payload"""
        complete = f"""
            update {table} as t set status = 'completed', output = 'null', finished_at = now(),
                lease_token = null
            from unnest(%s::bigint[], %s::int[], %s::uuid[]) as u(id, attempt, tok)
            where t.id = u.id and t.attempt = u.attempt and t.lease_token = u.tok
              and t.status = 'running'"""
        done = 0
        started = time.perf_counter()
        while done < count:
            rows = conn.execute(claim, (batch,)).fetchall()
            if not rows:
                break
            cur = conn.execute(
                complete, ([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
            )
            done += cur.rowcount
        elapsed = time.perf_counter() - started
        conn.execute(f"drop table {table}")
    return done / elapsed


def simple_claim_loop(url: str, count: int, batch: int, threads: int) -> float:
    """Jobs/s of a bare claim-ids / mark-done loop (in ``threads`` threads) on a minimal table."""
    table = f"floor_simple_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f"create table {table} (id bigserial primary key, status text not null, "
            "payload jsonb, locked_at timestamptz)"
        )
        conn.execute(f"create index on {table} (id) where status = 'queued'")
        conn.execute(
            f"insert into {table} (status, payload) "
            "select 'queued', 'null'::jsonb from generate_series(1, %s)",
            (count,),
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
    return count / elapsed


def wakeup(url: str, samples: int, pause: float) -> list[float]:
    """Milliseconds from an INSERT's start to the claim of its row by a listening thread,
    ``samples`` times, each after ``pause`` seconds of idleness (as runlane's latency)."""
    with psycopg.connect(url, autocommit=True) as conn:
        table = _table(conn)
    insert = (
        f"with i as (insert into {table} (id, task_id, queue, payload) "
        "values (%s, 'bench.ping', 'default', 'null') returning queue) "
        f"select pg_notify('{table}', queue) from i"
    )
    claim = (
        f"update {table} set status = 'running', updated_at = now() where id in ("
        f"select id from {table} where status = 'queued' and due_at <= now() "
        "order by priority desc, due_at, id limit 8 for update skip locked) returning id"
    )
    claimed: dict[uuid.UUID, float] = {}
    arrived = threading.Event()
    stop = threading.Event()
    listening = threading.Event()

    def claimer() -> None:
        with (
            psycopg.connect(url, autocommit=True) as listen,
            psycopg.connect(url, autocommit=True, options="-c synchronous_commit=off") as conn,
        ):
            listen.execute(f'listen "{table}"')
            listening.set()
            while not stop.is_set():
                for _ in listen.notifies(timeout=0.2, stop_after=1):
                    for (run_id,) in conn.execute(claim, prepare=True).fetchall():
                        claimed[run_id] = time.perf_counter()
                    arrived.set()

    thread = threading.Thread(target=claimer, name="floor-claimer")
    thread.start()
    latencies: list[float] = []
    try:
        listening.wait(10)
        with psycopg.connect(url, autocommit=True) as conn:
            for i in range(samples + 1):
                time.sleep(pause)
                arrived.clear()
                run_id = new_run_id()
                sent = time.perf_counter()
                conn.execute(insert, (run_id,), prepare=True)
                if not arrived.wait(10):
                    raise TimeoutError("the floor's wake-up never arrived")
                if i:  # the first sample warms up the connections
                    latencies.append((claimed[run_id] - sent) * 1000)
            conn.execute(f"drop table {table}")
    finally:
        stop.set()
        thread.join(5)
    return latencies
