"""``runlane demo``: the whole path on a throw-away database, in a few seconds; with
``--lane rabbitmq``, through a private RabbitMQ node (or ``--amqp-url``) to a worker."""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from typing import Any

import attrs

from runlane.cli._rabbit_host import rabbitmq_available
from runlane.cli._rabbit_nodes import RabbitNode, start_rabbitmq_node
from runlane.cli._setup import DATABASE_URL_HELP, given_database_url
from runlane.cli._target import LoadApp
from runlane.context import RunContext
from runlane.errors import ConfigurationError, NonRetryableError
from runlane.models import RunHandle
from runlane.postgres import apply_postgres_storage_migrations, postgres_polling_lane
from runlane.retry import RetryPolicy
from runlane.runtime import Runlane, create_runlane
from runlane.tasks import queue, task
from runlane.testing import start_embedded_postgres
from runlane.toolkit import as_int, count_of, shown

__all__ = ["DEMO_LANES", "add_demo_command", "run_demo"]

DEMO_LANES = ("polling", "rabbitmq")
WAIT_SECONDS = 60.0  # per run, on the RabbitMQ lane


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


def run_demo(
    *,
    database_url: str | None,
    schema: str,
    count: int,
    lane: str = "polling",
    amqp_url: str | None = None,
) -> None:
    """Trigger ``count`` runs (and one refused run) and execute them: drained in this thread
    on the polling lane; on the RabbitMQ lane, delivered through a broker (``amqp_url``, or a
    private node started from the Debian rabbitmq-server package) to a worker."""
    if lane not in DEMO_LANES:
        raise ConfigurationError(f"lane must be one of {', '.join(DEMO_LANES)}, got {shown(lane)}")
    if lane == "rabbitmq" and amqp_url is None:
        reason = rabbitmq_available()
        if reason is not None:
            raise ConfigurationError(f"cannot start a RabbitMQ node for the demo: {reason}")
    server = None
    node: RabbitNode | None = None
    if database_url is None:
        print("starting a throw-away PostgreSQL (embedded-postgres) ...", flush=True)
        database_url, server = start_embedded_postgres()
    try:
        result = apply_postgres_storage_migrations(connection_string=database_url, schema=schema)
        print(f"schema {schema} at version {result.version}")
        if lane == "polling":
            _polling(database_url, schema, count)
            return
        if amqp_url is None:
            print("starting a private RabbitMQ node (rabbitmq-server) ...", flush=True)
            amqp_url, node = start_rabbitmq_node()
        _rabbitmq(database_url, schema, count, amqp_url)
    finally:
        if node is not None:
            node.cleanup()
        if server is not None:
            server.cleanup()


def _print_runs(runlane: Runlane, handles: list[RunHandle]) -> None:
    for handle in handles:
        snap = runlane.get_run(handle.id)
        detail = snap.output if snap.error is None else snap.error.message
        print(f"  {snap.id}  {snap.status.value:<9}  {detail}")


def _polling(database_url: str, schema: str, count: int) -> None:
    runlane = create_runlane(
        lane=postgres_polling_lane(connection_string=database_url, schema=schema),
        queues=[queue("demo", default=True)],
        tasks=[square],
    )
    with runlane:
        handles = runlane.trigger_many(square, [Square(n=n) for n in range(count)])
        refused = runlane.trigger(square, {"n": -1})
        print(f"triggered {count_of(len(handles) + 1, 'run')}")
        drained = runlane.drain()
        print(f"drain executed {count_of(drained.runs_executed, 'run')}")
        _print_runs(runlane, [*handles, refused])


def _rabbitmq(database_url: str, schema: str, count: int, amqp_url: str) -> None:
    from runlane.rabbitmq import (  # noqa: PLC0415 - the rabbitmq extra (pika)
        RabbitMQStatus,
        rabbitmq_lane,
    )

    lane = rabbitmq_lane(connection_string=database_url, schema=schema, amqp_url=amqp_url)
    runlane = create_runlane(lane=lane, queues=[queue("demo", default=True)], tasks=[square])
    with runlane:
        worker = runlane.create_delivery_worker(concurrency=4)
        try:
            handles = runlane.trigger_many(square, [Square(n=n) for n in range(count)])
            refused = runlane.trigger(square, {"n": -1})
            print(
                f"triggered {count_of(len(handles) + 1, 'run')}; publishing them to {lane.broker}"
            )
            all_handles = [*handles, refused]
            for handle in all_handles:
                runlane.wait_for_run(handle.id, timeout=WAIT_SECONDS)
            print(
                f"a worker consuming runlane.{schema}.default.demo executed "
                f"{count_of(len(all_handles), 'run')}"
            )
        finally:
            worker.close(timeout=10)
        _print_runs(runlane, all_handles)
        status = RabbitMQStatus.of(runlane.status())
        print(f"pending outbox items: {status.outbox_pending}; broker {status.broker}")


def _cmd_demo(args: argparse.Namespace) -> int:
    as_int("--runs", args.runs, 0)
    run_demo(
        database_url=given_database_url(args.database_url),
        schema=args.schema,
        count=args.runs,
        lane=args.lane,
        amqp_url=args.amqp_url or os.environ.get("RUNLANE_AMQP_URL") or None,
    )
    return 0


def add_demo_command(commands: Any, load_app: LoadApp) -> None:
    """``demo`` (``load_app`` unused: it brings its own tasks)."""
    demo = commands.add_parser(
        "demo",
        help="trigger and drain a few runs on a throw-away (or given) database",
        description=(
            "Trigger a few runs and execute them. --lane polling (the default) drains them in "
            "this process; --lane rabbitmq publishes them through RabbitMQ to a worker: the "
            "broker at --amqp-url, else a private node on 127.0.0.1 started from the Debian "
            "rabbitmq-server package (apt-get install rabbitmq-server) and removed afterwards."
        ),
    )
    demo.add_argument(
        "--database-url",
        help=DATABASE_URL_HELP[:-1] + "; without any, a throw-away embedded server)",
    )
    demo.add_argument(
        "--schema", default="runlane_demo", help="schema name (default: runlane_demo)"
    )
    demo.add_argument("--runs", type=int, default=5, help="how many runs to trigger")
    demo.add_argument(
        "--lane",
        choices=DEMO_LANES,
        default="polling",
        help="polling (default), or rabbitmq: deliveries through a RabbitMQ broker",
    )
    demo.add_argument(
        "--amqp-url",
        help="with --lane rabbitmq: the broker (default: $RUNLANE_AMQP_URL; without it, a "
        "private node on 127.0.0.1)",
    )
    demo.set_defaults(handler=_cmd_demo)
