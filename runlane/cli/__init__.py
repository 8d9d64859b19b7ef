"""The ``runlane`` command line: migrate, grant, worker, maintenance, drain, status and demo.

``APP`` arguments name a :class:`~runlane.Runlane` as ``module:attribute`` (for example
``myapp.runlane:runlane``), imported the way ``python -c "import module"`` would from the
current directory.

Errors raised by runlane (a bad ``APP``, a missing schema, an unreachable database, ...) are
printed as one line, ``runlane: error: <message>``, without a traceback. Exit codes: 0
success (also after a clean close on SIGTERM/SIGINT), 1 a runtime failure, 2 a usage or
configuration error, 3 a second SIGTERM/SIGINT stopped a worker or the maintenance services
at once.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import attrs

from runlane._codec import exception_text
from runlane._operator.status import format_report, report_document, unhealthy
from runlane.cli._budget import add_limit_option, limits_of, non_default_limits, with_limits
from runlane.cli._codes import EXIT_CONFIGURATION, EXIT_FAILURE, EXIT_FORCED, EXIT_PIPE
from runlane.cli._demo import DEMO_LANES, run_demo
from runlane.cli._devdb import add_devdb_command
from runlane.cli._line import ProgressLine
from runlane.cli._logs import (
    begin_command,
    configure_logging,
    flush_logging,
    json_lines,
    logging_options,
    say,
    stop_logging,
)
from runlane.cli._operator import add_operator_commands, format_workers, plain
from runlane.cli._runs import add_run_commands
from runlane.cli._signals import Stopper, stop_requested
from runlane.cli._target import TARGET_HELP, Target, add_target_options, target_runtime
from runlane.cli._web import add_web_command
from runlane.errors import (
    ConfigurationError,
    RunlaneClosed,
    RunlaneError,
    ServiceFailed,
    WorkerFailed,
)
from runlane.maintenance import MaintenanceResult, ServiceErrorInfo, Services
from runlane.models import DrainResult
from runlane.postgres import (
    GRANT_JOBS,
    GRANT_LANES,
    apply_postgres_storage_migrations,
    grant_postgres_role,
    postgres_grant_sql,
)
from runlane.runtime import DEFAULT_WAIT_FOR_DATABASE, Runlane
from runlane.toolkit import (
    Deadline,
    as_int,
    as_wait_timeout,
    clipped,
    count_of,
    shown,
    wait_event,
    wait_in_slices,
)

__all__ = ["EXIT_CONFIGURATION", "EXIT_FAILURE", "EXIT_FORCED", "EXIT_PIPE", "load_app", "main"]

DATABASE_URL_HELP = "PostgreSQL URL (default: $RUNLANE_DATABASE_URL, then $DATABASE_URL)"

EPILOG = """\
exit codes:
  0  success, including a clean close after SIGTERM or SIGINT
  1  a runtime failure (database unreachable, schema not migrated, a worker or service failed)
  2  a usage or configuration error (bad arguments, APP not found, invalid configuration)
  3  a second SIGTERM/SIGINT stopped `worker` or `maintenance` at once; runs still executing
     are left to lease expiry (they are retried once their lease lapses)
  1  also: `status` found an unhealthy check (each is named on stderr)
  141 the reader of stdout went away (`runlane status APP | head -1`)

`runlane` alone prints this help and exits 0. The database URL of `migrate`, `grant` and `demo`
comes from --database-url, then $RUNLANE_DATABASE_URL, then $DATABASE_URL; commands taking
APP use the URL the application gave its lane.

Errors are printed as one line, `runlane: error: <message>`, without a traceback
(`--traceback` prints it too, e.g. for an APP whose module raised while importing).
"""

log = logging.getLogger("runlane.cli")

# how long the main thread gives the closer a stop signal started while the start waited
_WAIT_CLOSE_SECONDS = 10.0


def load_app(spec: str) -> Runlane:
    """Import ``module:attribute`` and return the Runlane it names; a ConfigurationError
    says what is wrong with ``spec``."""
    module_name, sep, attribute = spec.partition(":")
    dotted = (module_name, attribute)
    if not sep or not all(part.isidentifier() for name in dotted for part in name.split(".")):
        # a path or a relative name ("../app:x", ".app:x") is no module import_module takes
        raise ConfigurationError(
            f"APP must look like module:attribute, dotted Python names (e.g. "
            f"myproject.tasks:runlane, imported from the current directory), got {shown(spec)}"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(
            f"cannot import {shown(module_name)}: {clipped(exception_text(exc))}"
        ) from exc
    except (Exception, SystemExit) as exc:  # the module's own code failed while importing
        raise ConfigurationError(
            f"importing {shown(module_name)} failed: {type(exc).__name__}: "
            f"{clipped(' '.join(exception_text(exc).split()))}{_where(exc)} "
            "(run with --traceback for the whole traceback)"
        ) from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise ConfigurationError(
                f"{shown(module_name)} has no attribute {shown(attribute)}"
            ) from exc
    if not isinstance(target, Runlane):
        raise ConfigurationError(
            f"{shown(spec)} is a {type(target).__name__}, not a Runlane made by create_runlane"
        )
    return target


def _where(exc: BaseException) -> str:
    """`` (at path:line)``: the innermost frame of the application's code (not the standard
    library's, nor the import machinery's) in the traceback, where the import failed."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" (at {exc.filename}:{exc.lineno})"
    package = os.path.dirname(os.path.dirname(__file__))  # runlane/, not only runlane/cli/
    skipped = ("<", sysconfig.get_paths()["stdlib"], package + os.sep)
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith(skipped)
    ]
    if not frames:
        return ""
    return f" (at {frames[-1].filename}:{frames[-1].lineno})"


def _database_url(given: str | None) -> str:
    url = given or os.environ.get("RUNLANE_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if not url:
        raise ConfigurationError(
            "no database URL: pass --database-url, or set RUNLANE_DATABASE_URL or DATABASE_URL"
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


def _cmd_grant(args: argparse.Namespace) -> int:
    if args.print_sql:
        sys.stdout.write(
            postgres_grant_sql(job=args.job, role=args.role, schema=args.schema, lane=args.lane)
        )
        return 0
    result = grant_postgres_role(
        connection_string=_database_url(args.database_url),
        job=args.job,
        role=args.role,
        schema=args.schema,
        lane=args.lane,
    )
    print(
        f"schema {result.schema}: granted the {result.job} job ({result.lane} lane) "
        f"to role {result.role}"
    )
    return 0


def _queues(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def _cmd_drain(args: argparse.Namespace) -> int:
    runlane = load_app(args.app)
    # a terminal's progress line is not a JSON object: none under --log-format json
    progress = _DrainProgress() if sys.stderr.isatty() and not json_lines() else None
    try:
        result = runlane.drain(
            max_runs=args.max_runs, queues=_queues(args.queues), on_progress=progress
        )
    finally:
        if progress is not None:
            progress.finish()
        runlane.close()
    summary = (
        f"Executed {count_of(result.runs_executed, 'run')}: {result.completed} completed, "
        f"{result.failed} failed, {result.retried} retried"
    )
    if json_lines():  # every line is JSON: the summary is a record with the counts
        log.info(summary, extra=attrs.asdict(result))
    else:
        print(summary)
    return 0


class _DrainProgress:
    """``drain``'s progress line (a terminal), after the log lines written so far."""

    def __init__(self) -> None:
        self._line = ProgressLine(before_write=flush_logging)

    def __call__(self, result: DrainResult) -> None:
        self._line.show(
            f"runlane: drain: {count_of(result.runs_executed, 'run')} ({result.completed} "
            f"completed, {result.failed} failed, {result.retried} retried)"
        )

    def finish(self) -> None:
        self._line.finish()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _supervise(
    stopper: Stopper, wait_until_closed: Callable[[], object], shutdown_timeout: float
) -> int:
    """Observe a worker or services until they close; 0 after a clean close.
    ``wait_until_closed`` waits in slices (``wait_in_slices``), so that a stop signal the
    kernel delivered to another thread is handled."""
    try:
        wait_until_closed()
    except (WorkerFailed, ServiceFailed) as exc:
        if not stopper.requested.is_set():
            raise
        # asked to stop: a failure seen while closing is reported, the close stays clean
        say(f"warning: while closing: {_one_line(exc)}", logging.WARNING)
    finally:
        stopper.wait_for_closer(shutdown_timeout)
    if stopper.close_error is not None:
        if isinstance(stopper.close_error, RunlaneError):
            raise stopper.close_error
        raise RuntimeError(f"closing failed: {stopper.close_error!r}") from stopper.close_error
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    if args.limits and not args.with_maintenance:
        raise ConfigurationError(
            "--limit sets the budgets of the maintenance services --with-maintenance runs "
            "beside the worker: add --with-maintenance, or give --limit to `runlane "
            "maintenance APP`"
        )
    runlane = load_app(args.app)
    stopper = Stopper()
    try:
        with stopper.installed():
            # a stop signal while the start waits for the database ends the wait
            stopper.attach("runlane worker", runlane.close)
            try:
                # connects and checks the schema before any thread starts: an unmigrated
                # schema fails here, with the migrate hint
                worker = runlane.create_delivery_worker(
                    concurrency=args.concurrency,
                    queues=_queues(args.queues),
                    claim_batch=args.claim_batch,
                    wait_for_database=args.wait_for_database,
                )
            except RunlaneClosed:
                if not stopper.requested.is_set():
                    raise
                return _stopped_while_waiting(stopper)
            services: Services | None = None
            limits = limits_of(args)
            try:
                if args.with_maintenance:
                    services = runlane.start_services(
                        on_service_error=_report_service_error,
                        limits=limits,
                        wait_for_database=args.wait_for_database,
                    )

                def close() -> None:
                    # one bound for both: --shutdown-timeout is the whole close's
                    deadline = Deadline(args.shutdown_timeout)
                    worker.close(timeout=deadline.left())
                    if services is not None:
                        services.close(timeout=deadline.left())

                stopper.attach(worker.name, close)
                beside = (
                    f" with maintenance ({services.name}{with_limits(non_default_limits(limits))})"
                    if services is not None
                    else ""
                )
                say(
                    f"{worker.name} running {count_of(args.concurrency, 'slot')}{beside} "
                    f"(environment {runlane.environment!r}); SIGTERM or Ctrl-C stops it",
                    worker=worker.name,
                    concurrency=args.concurrency,
                    environment=runlane.environment,
                )
                code = _supervise(
                    stopper, lambda: _wait_for_both(worker, services), args.shutdown_timeout
                )
                say(f"{worker.name} stopped", worker=worker.name, exit_code=code)
                return code
            finally:
                worker.close(timeout=args.shutdown_timeout)  # idempotent
                if services is not None:
                    services.close(timeout=args.shutdown_timeout)
                runlane.close()
    finally:
        runlane.close()


def _stopped_while_waiting(stopper: Stopper) -> int:
    """A stop signal closed the runtime while the start waited for the database: a clean
    stop (0), nothing had started."""
    stopper.wait_for_closer(_WAIT_CLOSE_SECONDS)
    say("stopped while waiting for the database", exit_code=0)
    return 0


def _report_service_error(error: BaseException, info: ServiceErrorInfo) -> None:
    say(
        f"{info.phase} ({info.operation}): {_one_line(error)}",
        logging.WARNING,
        phase=info.phase,
        operation=info.operation,
    )


def _wait_for_both(worker: Any, services: Services | None) -> None:
    """Observe a worker and the services beside it; when either closes (or fails) the
    other is closed too, and a failure propagates. Every wait is sliced (see _signals)."""
    if services is None:
        wait_in_slices(worker.wait_until_closed)
        return
    try:
        wait_in_slices(lambda seconds: worker.wait_until_closed(seconds) or services.closed)
    finally:
        worker.close()
        services.close()
    wait_in_slices(worker.wait_until_closed)
    wait_in_slices(services.wait_until_closed)


def _cmd_maintenance(args: argparse.Namespace) -> int:
    limits = limits_of(args)
    if args.once and args.wait_for_database is not None:
        raise ConfigurationError(
            "--wait-for-database is for the long-running services: `maintenance --once` is "
            "a one-shot pass and fails at once when the database is unavailable"
        )
    if args.wait_for_database is None:
        args.wait_for_database = DEFAULT_WAIT_FOR_DATABASE
    runlane = load_app(args.app)

    stopper = Stopper()
    try:
        if args.once:
            result = runlane.run_maintenance_once(limits)
            if json_lines():
                log.info("maintenance pass done", extra=result.counts())
            else:
                print(_describe(result))
            return 0
        with stopper.installed():
            # a stop signal while the start waits for the database ends the wait
            stopper.attach("runlane maintenance", runlane.close)
            try:
                # an unmigrated schema fails here, with the migrate hint
                services = runlane.start_services(
                    on_service_error=_report_service_error,
                    limits=limits,
                    wait_for_database=args.wait_for_database,
                )
            except RunlaneClosed:
                if not stopper.requested.is_set():
                    raise
                return _stopped_while_waiting(stopper)
            try:
                stopper.attach(services.name, lambda: services.close(timeout=args.shutdown_timeout))
                changed = non_default_limits(limits)
                say(
                    f"{services.name} maintaining environment {runlane.environment!r}"
                    f"{with_limits(changed)}; SIGTERM or Ctrl-C stops it",
                    services=services.name,
                    environment=runlane.environment,
                    limits=changed,
                )
                code = _supervise(
                    stopper,
                    lambda: wait_in_slices(services.wait_until_closed),
                    args.shutdown_timeout,
                )
                say(f"{services.name} stopped", services=services.name, exit_code=code)
                return code
            finally:
                services.close(timeout=args.shutdown_timeout)  # idempotent
                runlane.close()
    finally:
        runlane.close()


def _describe(result: MaintenanceResult) -> str:
    return "\n".join(f"{name:<24} {value}" for name, value in result.counts().items())


def _cmd_status(args: argparse.Namespace) -> int:
    runlane = target_runtime(Target(args.app, args), load_app)
    if args.watch is None:
        try:
            return _show_status(runlane, args.json)
        finally:
            runlane.close()
    try:
        with stop_requested() as stop:
            while not stop.is_set():
                if sys.stdout.isatty() and not args.json:
                    sys.stdout.write("\x1b[H\x1b[2J")  # clear the screen between reports
                _show_status(runlane, args.json)
                print(flush=True)
                wait_event(stop, args.watch)
    except KeyboardInterrupt:  # on a thread other than the main one, Ctrl-C still stops it
        pass
    finally:
        runlane.close()
    return 0


def _show_status(runlane: Runlane, as_json: bool) -> int:
    """Print one report; 1 (with each failing check on stderr) when a check is unhealthy."""
    report = runlane.status()
    workers = runlane.list_workers()
    problems = unhealthy(report)
    if as_json:
        document = {**report_document(report), "workers": plain(workers), "unhealthy": problems}
        print(json.dumps(document, default=str, indent=2))
    else:
        print("\n".join([*format_report(report), *format_workers(workers)]), flush=True)
    for problem in problems:
        say(f"unhealthy: {problem}")
    return EXIT_FAILURE if problems else 0


def _cmd_demo(args: argparse.Namespace) -> int:
    url = (
        args.database_url
        or os.environ.get("RUNLANE_DATABASE_URL")
        or os.environ.get("DATABASE_URL")
        or None
    )
    as_int("--runs", args.runs, 0)
    run_demo(
        database_url=url,
        schema=args.schema,
        count=args.runs,
        lane=args.lane,
        amqp_url=args.amqp_url or os.environ.get("RUNLANE_AMQP_URL") or None,
    )
    return 0


def _version() -> str:
    try:
        return metadata.version("runlane")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree, not installed
        return "unknown"


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value!r}")
    return seconds


def _wait_seconds(value: str) -> float:
    """--wait-for-database: seconds >= 0 (0: fail at once), ``inf`` for as long as it takes
    (as_wait_timeout's 100 years)."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    try:
        limit = as_wait_timeout("--wait-for-database", seconds, unbounded="inf")
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert limit is not None  # a float is never None
    return limit


def _add_wait_option(parser: argparse.ArgumentParser, default: float | None) -> None:
    parser.add_argument(
        "--wait-for-database",
        type=_wait_seconds,
        default=default,
        metavar="SECONDS",
        help="how long the start waits for a database that is restarting, starting up, "
        "refusing connections or out of connection slots, logging a line per retry "
        f"(default {DEFAULT_WAIT_FOR_DATABASE:g}; 0 fails at once; inf waits as long as it "
        "takes); a host that does not resolve, a refused password, a missing database or "
        "schema fail at once",
    )


def _shutdown_seconds(value: str) -> float:
    """--shutdown-timeout: the close timeout's one rule (``as_wait_timeout``), ``inf`` for
    as long as it takes. -1 and nan made close() refuse it only at the stop signal (the
    process then hung until SIGKILL): they are refused before the command starts."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    try:
        limit = as_wait_timeout("--shutdown-timeout", seconds, unbounded="inf")
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert limit is not None  # a float is never None
    return limit


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runlane",
        description="Durable task runs on PostgreSQL.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"runlane {_version()}")
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="print the whole traceback before an error's one line (also after the command)",
    )
    logging_options(parser, argparse_default=False)
    # the same options after the command (`runlane worker APP --log-level DEBUG`)
    logged = argparse.ArgumentParser(add_help=False)
    logging_options(logged, argparse_default=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    migrate = commands.add_parser(
        "migrate", help="install or upgrade the storage schema (a deployment step)"
    )
    migrate.add_argument("--database-url", help=DATABASE_URL_HELP)
    migrate.add_argument("--schema", default="runlane", help="schema name (default: runlane)")
    migrate.set_defaults(handler=_cmd_migrate)

    grant = commands.add_parser(
        "grant",
        help="grant a database role only what one job needs (see docs/security.md)",
        description=(
            "Grant ROLE the privileges of JOB in the schema: producer (trigger and read runs, "
            "wait tokens), worker (execute runs), maintenance (the maintenance services), "
            "operator (inspect, retry, cancel). Connect as the schema's owner; ROLE must "
            "exist. --print writes the SQL instead of running it."
        ),
    )
    grant.add_argument("job", metavar="JOB", choices=GRANT_JOBS, help=", ".join(GRANT_JOBS))
    grant.add_argument("role", metavar="ROLE", help="an existing PostgreSQL role")
    grant.add_argument("--schema", default="runlane", help="schema name (default: runlane)")
    grant.add_argument("--database-url", help=DATABASE_URL_HELP)
    grant.add_argument(
        "--lane",
        choices=GRANT_LANES,
        default="polling",
        help="polling (default), or rabbitmq: also publishing the outbox, as every runtime "
        "of the RabbitMQ lane does",
    )
    grant.add_argument(
        "--print",
        dest="print_sql",
        action="store_true",
        help="write the SQL to stdout without connecting or applying it",
    )
    grant.set_defaults(handler=_cmd_grant)

    drain = commands.add_parser(
        "drain", parents=[logged], help="execute currently due runs, then exit"
    )
    drain.add_argument("app", metavar="APP", help="module:attribute naming a Runlane")
    drain.add_argument("--max-runs", type=int, default=None, help="stop after this many runs")
    drain.add_argument("--queues", default=None, help="comma-separated queue names")
    drain.set_defaults(handler=_cmd_drain)

    worker = commands.add_parser(
        "worker", parents=[logged], help="execute runs until SIGTERM or SIGINT"
    )
    worker.add_argument("app", metavar="APP", help="module:attribute naming a Runlane")
    worker.add_argument("--concurrency", type=int, default=4, help="handler threads (default 4)")
    worker.add_argument("--queues", default=None, help="comma-separated queue names (default: all)")
    worker.add_argument(
        "--shutdown-timeout",
        type=_shutdown_seconds,
        default=30.0,
        help="seconds handlers get to return after a stop signal, the whole close within it "
        "(default 30; inf: as long as they take)",
    )
    worker.add_argument(
        "--claim-batch",
        type=int,
        default=None,
        metavar="N",
        help="the most runs one claim takes (default twelve times --concurrency, at most 500); "
        "while a backlog of short handlers lasts the worker keeps up to about two claims "
        "ahead of its free slots: --claim-batch equal to --concurrency claims none ahead",
    )
    worker.add_argument(
        "--with-maintenance",
        action="store_true",
        help="also run the maintenance services in this process, closed with the worker",
    )
    _add_wait_option(worker, DEFAULT_WAIT_FOR_DATABASE)
    add_limit_option(worker, "for the services of --with-maintenance")
    worker.set_defaults(handler=_cmd_worker)

    _add_maintenance_command(commands, logged)

    status = commands.add_parser("status", help="print the progress signals to alert on")
    status.add_argument("app", metavar="APP", nargs="?", default=None, help=TARGET_HELP)
    add_target_options(status)
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument(
        "--watch",
        type=_positive_seconds,
        default=None,
        metavar="N",
        help="print the report again every N seconds until Ctrl-C (then exit 0)",
    )
    status.set_defaults(handler=_cmd_status)

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

    # runs list|show|retry|cancel|delete and trigger; queues, workers, schedules; web (which
    # imports Flask only when it runs); dev-db
    for add in (add_run_commands, add_operator_commands, add_web_command, add_devdb_command):
        add(commands, load_app)
    return parser


def _add_maintenance_command(
    commands: Any,
    logged: argparse.ArgumentParser,
) -> None:
    maintenance = commands.add_parser(
        "maintenance", parents=[logged], help="run maintenance services until SIGTERM or SIGINT"
    )
    maintenance.add_argument("app", metavar="APP", help="module:attribute naming a Runlane")
    maintenance.add_argument(
        "--once", action="store_true", help="run one bounded pass, print what it changed, exit"
    )
    maintenance.add_argument(
        "--shutdown-timeout",
        type=_shutdown_seconds,
        default=30.0,
        help="seconds to wait for the bands",
    )
    _add_wait_option(maintenance, None)  # None: the default, refused with --once
    add_limit_option(maintenance)
    maintenance.set_defaults(handler=_cmd_maintenance)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (see ``EPILOG``)."""
    parser = _parser()
    given = list(sys.argv[1:] if argv is None else argv)
    # --traceback is taken anywhere before a bare "--", also after the command
    end = given.index("--") if "--" in given else len(given)
    show_traceback = "--traceback" in given[:end]
    args = parser.parse_args([a for a in given[:end] if a != "--traceback"] + given[end:])
    args.traceback = show_traceback
    begin_command()
    if args.command is None:
        parser.print_help()
        return 0
    if args.command in {"worker", "maintenance", "drain"}:
        configure_logging(args.log_level, args.log_format)
    try:
        return _run(args)
    finally:
        stop_logging()


def _run(args: argparse.Namespace) -> int:
    try:
        code: int = args.handler(args)
    except BrokenPipeError:
        # the reader of stdout went away: stop quietly, and keep the interpreter's final
        # flush from failing too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_PIPE
    except RunlaneError as exc:
        code = EXIT_CONFIGURATION if isinstance(exc, ConfigurationError) else EXIT_FAILURE
        if json_lines():  # the traceback, when asked, goes in the record's "exception"
            info = exc if getattr(args, "traceback", False) else None
            log.error(  # noqa: TRY400 - the traceback only with --traceback
                "error: %s", _one_line(exc), exc_info=info, extra={"exit_code": code}
            )
            return code
        flush_logging()  # the lines logged before the error are written before it
        if getattr(args, "traceback", False):
            traceback.print_exception(exc, file=sys.stderr)
        say(f"error: {_one_line(exc)}")
        return code
    except Exception:
        if not json_lines():
            raise  # a bug: the whole traceback
        log.exception("unexpected error", extra={"exit_code": EXIT_FAILURE})
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    return code
