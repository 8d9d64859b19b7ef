"""``runlane drain APP``: execute the runs due now in this process, then exit."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import attrs

from runlane.cli._line import ProgressLine
from runlane.cli._logs import flush_logging, json_lines, logged_parent
from runlane.cli._options import queue_names
from runlane.cli._target import LoadApp
from runlane.models import DrainResult
from runlane.toolkit import count_of

__all__ = ["add_drain_command"]

log = logging.getLogger("runlane.cli")


def _cmd_drain(load_app: LoadApp, args: argparse.Namespace) -> int:
    runlane = load_app(args.app)
    # a terminal's progress line is not a JSON object: none under --log-format json
    progress = _DrainProgress() if sys.stderr.isatty() and not json_lines() else None
    try:
        result = runlane.drain(
            max_runs=args.max_runs, queues=queue_names(args.queues), on_progress=progress
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


def add_drain_command(commands: Any, load_app: LoadApp) -> None:
    drain = commands.add_parser(
        "drain", parents=[logged_parent()], help="execute currently due runs, then exit"
    )
    drain.add_argument("app", metavar="APP", help="module:attribute naming a Runlane")
    drain.add_argument("--max-runs", type=int, default=None, help="stop after this many runs")
    drain.add_argument("--queues", default=None, help="comma-separated queue names")
    drain.set_defaults(handler=lambda args: _cmd_drain(load_app, args))
