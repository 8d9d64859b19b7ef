"""What schema version 14's guard triggers cost the hot path (issue 37: least privilege held
by the database).

    python -m benchmarks.guards [--runs 2000] [--batch 100] [--rounds 8] [--database-url URL]

A role granted the worker job claims ``--runs`` queued runs and completes them in batches of
``--batch`` with runlane's own statements (``run_claim``, ``run_complete_many``), once with
the guard triggers enabled and once with them disabled (by the owner), alternating for
``--rounds`` rounds; the table gives the median microseconds of server round trip a run for
each, and their ratio (the disabled triggers are the floor). Figures are printed, never
asserted.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time
import uuid
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from benchmarks._common import (
    add_database_argument,
    fresh_schema,
    limit_row,
    log,
    print_table,
    server_url,
)
from runlane.postgres import grant_postgres_role
from runlane.postgres._sql import statements

GUARDS = ("runlane_runs_guard_transition", "runlane_runs_guard_tombstone")


def _round(
    owner: psycopg.Connection[Any],
    worker: psycopg.Connection[Any],
    schema: str,
    *,
    guarded: bool,
    runs: int,
    batch: int,
) -> tuple[float, float]:
    """Microseconds a run for claims and for completions, as the worker role."""
    text = statements(schema)
    s = sql.Identifier(schema)
    verb = sql.SQL("enable" if guarded else "disable")
    for trigger in GUARDS:
        owner.execute(
            sql.SQL("alter table {}.runs {} trigger {}").format(s, verb, sql.Identifier(trigger))
        )
    owner.execute(sql.SQL("truncate {s}.runs, {s}.attempts, {s}.steps").format(s=s))
    owner.execute(
        sql.SQL(
            "insert into {}.runs (id, environment, task_id, queue, status, payload, "
            "max_attempts, due_at) select gen_random_uuid(), 'default', 'bench', 'default', "
            "'queued', '{{}}', 3, now() from generate_series(1, %s)"
        ).format(s),
        (runs,),
    )
    owner.execute(sql.SQL("analyze {}.runs").format(s))
    claim = {
        "environment": "default",
        "queues": ["default"],
        "limit": batch,
        "lease_seconds": timedelta(minutes=5).total_seconds(),
        "concurrency_limit": None,
        "worker_id": None,
        "now": None,
    }
    claimed: list[tuple[uuid.UUID, int, uuid.UUID]] = []
    started = time.perf_counter()
    while len(claimed) < runs:
        rows = worker.execute(text["run_claim"], claim).fetchall()
        if not rows:
            break
        claimed.extend((row[0], row[3], row[6]) for row in rows)
    claims = (time.perf_counter() - started) / runs * 1e6
    started = time.perf_counter()
    for at in range(0, len(claimed), batch):
        chunk = claimed[at : at + batch]
        worker.execute(
            text["run_complete_many"],
            {
                "ids": [c[0] for c in chunk],
                "attempts": [c[1] for c in chunk],
                "lease_tokens": [c[2] for c in chunk],
                "outputs": "[" + ",".join("1" for _ in chunk) + "]",
                "now": None,
            },
        )
    completions = (time.perf_counter() - started) / runs * 1e6
    return claims, completions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=8)
    add_database_argument(parser)
    args = parser.parse_args()
    with server_url(args.database_url) as url:
        schema = fresh_schema(url)
        role = f"bench_worker_{secrets.token_hex(4)}"
        password = secrets.token_urlsafe(12)
        with psycopg.connect(url, autocommit=True) as owner:
            owner.execute(
                sql.SQL("create role {} login password {}").format(
                    sql.Identifier(role), sql.Literal(password)
                )
            )
            try:
                grant_postgres_role(connection_string=url, job="worker", role=role, schema=schema)
                conninfo = make_conninfo(url, user=role, password=password)
                figures: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
                with psycopg.connect(conninfo, autocommit=True) as worker:
                    for number in range(args.rounds):
                        for guarded in (False, True):
                            figures[guarded].append(
                                _round(
                                    owner,
                                    worker,
                                    schema,
                                    guarded=guarded,
                                    runs=args.runs,
                                    batch=args.batch,
                                )
                            )
                        log(f"round {number + 1}: {figures[False][-1]} / {figures[True][-1]}")
            finally:
                owner.execute(sql.SQL("drop owned by {}").format(sql.Identifier(role)))
                owner.execute(sql.SQL("drop role {}").format(sql.Identifier(role)))

    def median(guarded: bool, index: int) -> float:
        return statistics.median(f[index] for f in figures[guarded])

    rows = [
        limit_row(
            f"{name}, us a run (batches of {args.batch}, as the worker role)",
            median(True, index),
            None,
            "us",
            floor_label="guard triggers disabled",
            floor=median(False, index),
        )
        for index, name in enumerate(("claim", "completion"))
    ]
    print_table(
        rows,
        notes=[f"median of {args.rounds} alternating rounds of {args.runs:,} runs"],
        compare="floor",
    )


if __name__ == "__main__":
    main()
