"""The ``runlane`` command line: migrate, worker, maintenance, drain, status and demo.

``APP`` arguments name a :class:`~runlane.Runlane` as ``module:attribute`` (for example
``myapp.runlane:runlane``), imported the way ``python -c "import module"`` would from the
current directory.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

import attrs

from runlane._demo import run_demo
from runlane.errors import RunlaneError
from runlane.maintenance import MaintenanceResult, ServiceErrorInfo
from runlane.postgres import apply_postgres_storage_migrations
from runlane.runtime import Runlane

__all__ = ["load_app", "main"]


def load_app(spec: str) -> Runlane:
    """Import ``module:attribute`` and return the Runlane it names."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise SystemExit(f"runlane: APP must look like module:attribute, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(f"runlane: cannot import {module_name!r}: {exc}") from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise SystemExit(f"runlane: {module_name!r} has no attribute {attribute!r}") from exc
    if not isinstance(target, Runlane):
        raise SystemExit(
            f"runlane: {spec} is a {type(target).__name__}, not a Runlane made by create_runlane"
        )
    return target


def _database_url(given: str | None) -> str:
    url = given or os.environ.get("RUNLANE_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit(
            "runlane: no database URL: pass --database-url or set RUNLANE_DATABASE_URL"
        )
    return url


def _cmd_migrate(args: argparse.Namespace) -> int:
    result = apply_postgres_storage_migrations(
        connection_string=_database_url(args.database_url), schema=args.schema
    )
    if result.applied:
        applied = ", ".join(str(v) for v in result.applied)
        print(f"schema {result.schema}: applied {applied}; now at version {result.version}")
    else:
        print(f"schema {result.schema}: already at version {result.version}; nothing to do")
    return 0


def _queues(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def _cmd_drain(args: argparse.Namespace) -> int:
    runlane = load_app(args.app)
    try:
        result = runlane.drain(max_runs=args.max_runs, queues=_queues(args.queues))
    finally:
        runlane.close()
    print(f"Executed {result.runs_executed} runs")
    return 0


def _on_stop_signals(close: Callable[[], None]) -> None:
    """Run ``close`` in a fresh thread on the first SIGTERM or SIGINT."""
    fired = threading.Event()

    def handler(signum: int, frame: object) -> None:
        if fired.is_set():
            return
        fired.set()
        print(f"runlane: {signal.Signals(signum).name} received; closing", file=sys.stderr)
        threading.Thread(target=close, name="runlane-cli-closer", daemon=True).start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _cmd_worker(args: argparse.Namespace) -> int:
    runlane = load_app(args.app)
    try:
        worker = runlane.create_delivery_worker(
            concurrency=args.concurrency, queues=_queues(args.queues)
        )
        _on_stop_signals(lambda: worker.close(timeout=args.shutdown_timeout))
        print(
            f"runlane: {worker.name} running {args.concurrency} slots "
            f"(environment {runlane.environment!r}); SIGTERM or Ctrl-C stops it",
            file=sys.stderr,
        )
        try:
            worker.wait_until_closed()
        finally:
            worker.close(timeout=args.shutdown_timeout)
    finally:
        runlane.close()
    return 0


def _cmd_maintenance(args: argparse.Namespace) -> int:
    runlane = load_app(args.app)

    def report(error: BaseException, info: ServiceErrorInfo) -> None:
        print(f"runlane: {info.phase} ({info.operation}): {error}", file=sys.stderr)

    try:
        if args.once:
            print(_describe(runlane.run_maintenance_once()))
            return 0
        services = runlane.start_services(on_service_error=report)
        _on_stop_signals(lambda: services.close(timeout=args.shutdown_timeout))
        print(
            f"runlane: {services.name} maintaining environment {runlane.environment!r}; "
            "SIGTERM or Ctrl-C stops it",
            file=sys.stderr,
        )
        try:
            services.wait_until_closed()
        finally:
            services.close(timeout=args.shutdown_timeout)
    finally:
        runlane.close()
    return 0


def _describe(result: MaintenanceResult) -> str:
    return "\n".join(f"{name:<24} {value}" for name, value in attrs.asdict(result).items())


def _cmd_status(args: argparse.Namespace) -> int:
    runlane = load_app(args.app)
    try:
        report = runlane.status()
    finally:
        runlane.close()
    if args.json:
        print(json.dumps(attrs.asdict(report), default=str, indent=2))
        return 0
    rows = [
        ("queued and due", report.queued_due),
        ("running", report.running),
        ("retrying/released past due", report.deferred_past_due),
        ("expired active leases", report.expired_leases),
        ("stuck in cancellation_requested", report.stuck_cancellations),
        ("tombstones with children", report.tombstones_with_children),
        ("pending tokens past timeout", report.tokens_past_timeout),
        ("resolved tokens with waiting runs", report.resolved_tokens_with_waiting_runs),
        (
            "pending outbox work",
            "n/a (the polling lane has no outbox)"
            if report.outbox_pending is None
            else report.outbox_pending,
        ),
    ]
    print(f"environment {report.environment!r}")
    for label, value in rows:
        print(f"  {label:<34} {value}")
    if report.oldest_deferred_due_at is not None:
        print(f"  {'oldest deferred due at':<34} {report.oldest_deferred_due_at.isoformat()}")
    print("maintenance bands")
    if not report.maintenance_leases:
        print("  (no band has been owned yet: is `runlane maintenance` running?)")
    for lease in report.maintenance_leases:
        state = "live" if lease.live else "EXPIRED"
        print(
            f"  {lease.band:<12} fencing {lease.fencing:<6} {state:<8} "
            f"until {lease.expires_at.isoformat()}  owner {lease.owner}"
        )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    run_demo(database_url=args.database_url, schema=args.schema, count=args.runs)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runlane", description="Durable task runs on PostgreSQL.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    migrate = commands.add_parser(
        "migrate", help="install or upgrade the storage schema (a deployment step)"
    )
    migrate.add_argument("--database-url", help="PostgreSQL URL (default: $RUNLANE_DATABASE_URL)")
    migrate.add_argument("--schema", default="runlane", help="schema name (default: runlane)")
    migrate.set_defaults(handler=_cmd_migrate)

    drain = commands.add_parser("drain", help="execute currently due runs, then exit")
    drain.add_argument("app", metavar="APP", help="module:attribute naming a Runlane")
    drain.add_argument("--max-runs", type=int, default=None, help="stop after this many runs")
    drain.add_argument("--queues", default=None, help="comma-separated queue names")
    drain.set_defaults(handler=_cmd_drain)

    worker = commands.add_parser("worker", help="execute runs until SIGTERM or SIGINT")
    worker.add_argument("app", metavar="APP", help="module:attribute naming a Runlane")
    worker.add_argument("--concurrency", type=int, default=4, help="handler threads (default 4)")
    worker.add_argument("--queues", default=None, help="comma-separated queue names (default: all)")
    worker.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds handlers get to return after a stop signal (default 30)",
    )
    worker.set_defaults(handler=_cmd_worker)

    maintenance = commands.add_parser(
        "maintenance", help="run maintenance services until SIGTERM or SIGINT"
    )
    maintenance.add_argument("app", metavar="APP", help="module:attribute naming a Runlane")
    maintenance.add_argument(
        "--once", action="store_true", help="run one bounded pass, print what it changed, exit"
    )
    maintenance.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds to wait for the bands"
    )
    maintenance.set_defaults(handler=_cmd_maintenance)

    status = commands.add_parser("status", help="print the progress signals to alert on")
    status.add_argument("app", metavar="APP", help="module:attribute naming a Runlane")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(handler=_cmd_status)

    demo = commands.add_parser(
        "demo", help="trigger and drain a few runs on a throw-away (or given) database"
    )
    demo.add_argument("--database-url", help="use this server instead of an embedded one")
    demo.add_argument(
        "--schema", default="runlane_demo", help="schema name (default: runlane_demo)"
    )
    demo.add_argument("--runs", type=int, default=5, help="how many runs to trigger")
    demo.set_defaults(handler=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code: int = args.handler(args)
    except RunlaneError as exc:
        print(f"runlane: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
