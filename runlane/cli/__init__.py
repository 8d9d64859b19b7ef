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
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from importlib import metadata

from runlane.cli._app import load_app
from runlane.cli._audit import add_audit_command
from runlane.cli._codes import EXIT_CONFIGURATION, EXIT_FAILURE, EXIT_FORCED, EXIT_PIPE
from runlane.cli._demo import add_demo_command
from runlane.cli._devdb import add_devdb_command
from runlane.cli._drain import add_drain_command
from runlane.cli._logs import (
    begin_command,
    configure_logging,
    flush_logging,
    json_lines,
    logging_options,
    one_line,
    say,
    stop_logging,
)
from runlane.cli._metrics import add_metrics_command
from runlane.cli._operator import add_operator_commands
from runlane.cli._runs import add_run_commands
from runlane.cli._setup import DATABASE_URL_HELP, add_setup_commands
from runlane.cli._stats import add_stats_command
from runlane.cli._status import add_status_command
from runlane.cli._supervised import add_supervised_commands
from runlane.cli._web import add_web_command
from runlane.errors import ConfigurationError, RunlaneError

__all__ = [
    "DATABASE_URL_HELP",
    "EXIT_CONFIGURATION",
    "EXIT_FAILURE",
    "EXIT_FORCED",
    "EXIT_PIPE",
    "load_app",
    "main",
]

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


def _version() -> str:
    try:
        return metadata.version("runlane")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree, not installed
        return "unknown"


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
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    # each module adds its commands, in the order of the help; web imports Flask only when
    # it runs
    for add in (
        add_setup_commands,  # migrate, grant
        add_drain_command,
        add_supervised_commands,  # worker, maintenance
        add_status_command,
        add_stats_command,
        add_demo_command,
        add_run_commands,  # runs list|show|retry|cancel|delete, trigger
        add_operator_commands,  # queues, workers, schedules
        add_audit_command,
        add_web_command,
        add_metrics_command,
        add_devdb_command,
    ):
        add(commands, load_app)
    return parser


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
                "error: %s", one_line(exc), exc_info=info, extra={"exit_code": code}
            )
            return code
        flush_logging()  # the lines logged before the error are written before it
        if getattr(args, "traceback", False):
            traceback.print_exception(exc, file=sys.stderr)
        say(f"error: {one_line(exc)}")
        return code
    except Exception:
        if not json_lines():
            raise  # a bug: the whole traceback
        log.exception("unexpected error", extra={"exit_code": EXIT_FAILURE})
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    return code
