"""``runlane demo``: the whole path on a throw-away database, in a few seconds."""

from __future__ import annotations

from datetime import timedelta

import attrs

from runlane.context import RunContext
from runlane.errors import NonRetryableError
from runlane.postgres import apply_postgres_storage_migrations, postgres_polling_lane
from runlane.retry import RetryPolicy
from runlane.runtime import create_runlane
from runlane.tasks import queue, task
from runlane.testing import start_embedded_postgres

__all__ = ["run_demo"]


@attrs.frozen
class Square:
    n: int


@task(
    id="demo.square",
    schema=Square,
    queue="demo",
    retry=RetryPolicy(max_attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0)),
)
def square(payload: Square, context: RunContext) -> dict[str, int]:
    if payload.n < 0:
        raise NonRetryableError("negative numbers are refused")
    return {"n": payload.n, "square": payload.n * payload.n}


def run_demo(*, database_url: str | None, schema: str, count: int) -> None:
    server = None
    if database_url is None:
        print("starting a throw-away PostgreSQL (embedded-postgres) ...")
        database_url, server = start_embedded_postgres()
    try:
        result = apply_postgres_storage_migrations(connection_string=database_url, schema=schema)
        print(f"schema {schema} at version {result.version}")
        runlane = create_runlane(
            lane=postgres_polling_lane(connection_string=database_url, schema=schema),
            queues=[queue("demo", default=True)],
            tasks=[square],
        )
        with runlane:
            handles = runlane.trigger_many(square, [Square(n=n) for n in range(count)])
            refused = runlane.trigger(square, {"n": -1})
            print(f"triggered {len(handles) + 1} runs")
            drained = runlane.drain()
            print(f"drain executed {drained.runs_executed} runs")
            for handle in [*handles, refused]:
                snap = runlane.get_run(handle.id)
                detail = snap.output if snap.error is None else snap.error.message
                print(f"  {snap.id}  {snap.status.value:<9}  {detail}")
    finally:
        if server is not None:
            server.cleanup()
