"""The ``runlane`` command line: migrate, worker, maintenance, drain, status and demo.

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
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from types import FrameType
from typing import Any

import attrs

from runlane._cli_runs import add_run_commands
from runlane._demo import run_demo
from runlane.errors import ConfigurationError, RunlaneError, ServiceFailed, WorkerFailed
from runlane.maintenance import MaintenanceResult, ServiceErrorInfo
from runlane.postgres import apply_postgres_storage_migrations
from runlane.runtime import Runlane

__all__ = ["EXIT_CONFIGURATION", "EXIT_FAILURE", "EXIT_FORCED", "load_app", "main"]

EXIT_FAILURE = 1  # a runtime failure: the database, the schema, a failed worker or service
EXIT_CONFIGURATION = 2  # a usage or configuration error (argparse uses 2 as well)
EXIT_FORCED = 3  # a second SIGTERM/SIGINT: exited at once, runs left to lease expiry

EPILOG = """\
exit codes:
  0  success, including a clean close after SIGTERM or SIGINT
  1  a runtime failure (database unreachable, schema not migrated, a worker or service failed)
  2  a usage or configuration error (bad arguments, APP not found, invalid configuration)
  3  a second SIGTERM/SIGINT stopped `worker` or `maintenance` at once; runs still executing
     are left to lease expiry (they are retried once their lease lapses)

Errors are printed as one line, `runlane: error: <message>`, without a traceback.
"""

log = logging.getLogger("runlane.cli")


def load_app(spec: str) -> Runlane:
    """Import ``module:attribute`` and return the Runlane it names; a ConfigurationError
    says what is wrong with ``spec``."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigurationError(f"APP must look like module:attribute, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise ConfigurationError(f"{module_name!r} has no attribute {attribute!r}") from exc
    if not isinstance(target, Runlane):
        raise ConfigurationError(
            f"{spec} is a {type(target).__name__}, not a Runlane made by create_runlane"
        )
    return target


def _database_url(given: str | None) -> str:
    url = given or os.environ.get("RUNLANE_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if not url:
        raise ConfigurationError("no database URL: pass --database-url or set RUNLANE_DATABASE_URL")
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


class _Stopper:
    """SIGTERM/SIGINT handling for a long-running command.

    The first signal closes gracefully in a fresh thread (the main thread keeps observing);
    a second one exits at once with ``EXIT_FORCED``, leaving runs still executing to lease
    expiry. Installed before the worker or services start, so no signal finds a gap; a
    signal that arrives before ``attach`` closes what is attached as soon as it is."""

    def __init__(self) -> None:
        self.name = "runlane"
        self._close: Callable[[], None] | None = None
        self.requested = threading.Event()
        self.close_error: BaseException | None = None
        self._closer: threading.Thread | None = None

    def attach(self, name: str, close: Callable[[], None]) -> None:
        self.name = name
        self._close = close
        if self.requested.is_set():
            self._start_closer()

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set():
            log.warning(
                "%s: second signal: exiting now; runs still executing are left to lease expiry",
                self.name,
            )
            _print("second signal: exiting now; runs still executing are left to lease expiry")
            os._exit(EXIT_FORCED)
        self.requested.set()
        _print(
            f"{signal.Signals(signum).name} received; closing {self.name} "
            "(a second signal exits at once)"
        )
        self._start_closer()

    def _start_closer(self) -> None:
        if self._close is None or self._closer is not None:
            return
        self._closer = threading.Thread(
            target=self._run_close, name="runlane-cli-closer", daemon=True
        )
        self._closer.start()

    def _run_close(self) -> None:
        assert self._close is not None
        try:
            self._close()
        except BaseException as exc:  # reported by the main thread
            self.close_error = exc

    def wait_for_closer(self) -> None:
        if self._closer is not None:
            self._closer.join()

    @contextmanager
    def installed(self) -> Iterator[None]:
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in previous:
            signal.signal(sig, self.handle)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _print(message: str) -> None:
    print(f"runlane: {message}", file=sys.stderr, flush=True)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _supervise(stopper: _Stopper, wait_until_closed: Callable[[], object]) -> int:
    """Observe a worker or services until they close; 0 after a clean close."""
    try:
        wait_until_closed()
    except (WorkerFailed, ServiceFailed) as exc:
        if not stopper.requested.is_set():
            raise
        # asked to stop: a failure seen while closing is reported, the close stays clean
        _print(f"warning: while closing: {_one_line(exc)}")
    finally:
        stopper.wait_for_closer()
    if stopper.close_error is not None:
        if isinstance(stopper.close_error, RunlaneError):
            raise stopper.close_error
        raise RuntimeError(f"closing failed: {stopper.close_error!r}") from stopper.close_error
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    runlane = load_app(args.app)
    stopper = _Stopper()
    try:
        with stopper.installed():
            # status() reads every table: an unmigrated schema fails here, with the migrate
            # hint, before any thread starts
            runlane.status()
            worker = runlane.create_delivery_worker(
                concurrency=args.concurrency, queues=_queues(args.queues)
            )
            try:
                stopper.attach(worker.name, lambda: worker.close(timeout=args.shutdown_timeout))
                _print(
                    f"{worker.name} running {args.concurrency} slots "
                    f"(environment {runlane.environment!r}); SIGTERM or Ctrl-C stops it"
                )
                return _supervise(stopper, worker.wait_until_closed)
            finally:
                worker.close(timeout=args.shutdown_timeout)  # idempotent
                runlane.close()
    finally:
        runlane.close()


def _cmd_maintenance(args: argparse.Namespace) -> int:
    runlane = load_app(args.app)

    def report(error: BaseException, info: ServiceErrorInfo) -> None:
        _print(f"{info.phase} ({info.operation}): {_one_line(error)}")

    stopper = _Stopper()
    try:
        if args.once:
            print(_describe(runlane.run_maintenance_once()))
            return 0
        with stopper.installed():
            runlane.status()  # an unmigrated schema fails here, with the migrate hint
            services = runlane.start_services(on_service_error=report)
            try:
                stopper.attach(services.name, lambda: services.close(timeout=args.shutdown_timeout))
                _print(
                    f"{services.name} maintaining environment {runlane.environment!r}; "
                    "SIGTERM or Ctrl-C stops it"
                )
                return _supervise(stopper, services.wait_until_closed)
            finally:
                services.close(timeout=args.shutdown_timeout)  # idempotent
                runlane.close()
    finally:
        runlane.close()


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
        ("pending outbox items", "n/a" if report.outbox_pending is None else report.outbox_pending),
    ]
    if report.outbox_oldest_age_seconds is not None:
        rows.append(("oldest pending outbox item", f"{report.outbox_oldest_age_seconds:.1f}s old"))
    if report.broker is not None:
        rows.append(("broker", report.broker))
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


def _version() -> str:
    try:
        return metadata.version("runlane")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree, not installed
        return "unknown"


def _logging_options(parser: argparse.ArgumentParser, *, argparse_default: bool) -> None:
    """``--log-level`` and ``--log-format``; on subcommands they default to SUPPRESS so that
    an option given before the command is not overwritten by the subcommand's default."""
    level_default: Any = argparse.SUPPRESS if argparse_default else "INFO"
    format_default: Any = argparse.SUPPRESS if argparse_default else "text"
    parser.add_argument(
        "--log-level",
        default=level_default,
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level of worker, maintenance and drain (default INFO)",
    )
    parser.add_argument(
        "--log-format",
        default=format_default,
        choices=["text", "json"],
        help="text lines or one JSON object per line (default text)",
    )


_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the record's structured
    fields (``extra=``) and the traceback, if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class _CliHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler ``runlane`` installs; replaced, not stacked, when main() runs again.

    It writes to whatever ``sys.stderr`` is when a record is emitted, so a thread that logs
    after ``main()`` returned (or after a test swapped stderr) never hits a closed stream."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        """The stream is always the current sys.stderr."""


def _configure_logging(level: str, fmt: str) -> None:
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _CliHandler)]:
        root.removeHandler(handler)
    handler = _CliHandler()
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runlane",
        description="Durable task runs on PostgreSQL.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"runlane {_version()}")
    _logging_options(parser, argparse_default=False)
    # the same options after the command (`runlane worker APP --log-level DEBUG`)
    logged = argparse.ArgumentParser(add_help=False)
    _logging_options(logged, argparse_default=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    migrate = commands.add_parser(
        "migrate", help="install or upgrade the storage schema (a deployment step)"
    )
    migrate.add_argument("--database-url", help="PostgreSQL URL (default: $RUNLANE_DATABASE_URL)")
    migrate.add_argument("--schema", default="runlane", help="schema name (default: runlane)")
    migrate.set_defaults(handler=_cmd_migrate)

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
        type=float,
        default=30.0,
        help="seconds handlers get to return after a stop signal (default 30)",
    )
    worker.set_defaults(handler=_cmd_worker)

    maintenance = commands.add_parser(
        "maintenance", parents=[logged], help="run maintenance services until SIGTERM or SIGINT"
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

    add_run_commands(commands, load_app)  # runs list|show|retry|cancel, trigger
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (see ``EPILOG``)."""
    args = _parser().parse_args(argv)
    if args.command in {"worker", "maintenance", "drain"}:
        _configure_logging(args.log_level, args.log_format)
    try:
        code: int = args.handler(args)
    except ConfigurationError as exc:
        _print(f"error: {_one_line(exc)}")
        return EXIT_CONFIGURATION
    except RunlaneError as exc:
        _print(f"error: {_one_line(exc)}")
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
