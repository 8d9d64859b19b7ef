"""``runlane status``: the progress signals to alert on, once or every N seconds."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from runlane._operator.status import format_report, report_document, unhealthy
from runlane.cli._codes import EXIT_FAILURE
from runlane.cli._logs import say
from runlane.cli._operator import format_workers, plain
from runlane.cli._options import positive_seconds
from runlane.cli._signals import stop_requested
from runlane.cli._target import TARGET_HELP, LoadApp, Target, add_target_options, target_runtime
from runlane.runtime import Runlane
from runlane.toolkit import wait_event

__all__ = ["add_status_command"]


def _cmd_status(load_app: LoadApp, args: argparse.Namespace) -> int:
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


def add_status_command(commands: Any, load_app: LoadApp) -> None:
    status = commands.add_parser("status", help="print the progress signals to alert on")
    status.add_argument("app", metavar="APP", nargs="?", default=None, help=TARGET_HELP)
    add_target_options(status)
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument(
        "--watch",
        type=positive_seconds,
        default=None,
        metavar="N",
        help="print the report again every N seconds until Ctrl-C (then exit 0)",
    )
    status.set_defaults(handler=lambda args: _cmd_status(load_app, args))
