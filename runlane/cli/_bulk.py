"""Bulk ``runlane runs retry|cancel|delete`` by filter: count, ask (or ``--yes``), then act
batch by batch, showing progress on a terminal; Ctrl-C stops between batches, and running
the command again finishes the rest (docs/operating.md, Bulk actions).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import datetime
from typing import Any

from runlane._operator.bulk import parse_filter_time
from runlane.cli._line import ProgressLine
from runlane.errors import ConfigurationError
from runlane.models import BulkResult
from runlane.runtime import Runlane
from runlane.toolkit import as_int, count_of, shown

__all__ = ["add_filter_options", "run_bulk"]

EXIT_INTERRUPTED = 130

_VERB = {"retry": "retried", "cancel": "cancelled", "delete": "deleted"}


def _timestamp(text: str) -> datetime:
    # the console's time filters are read by the same function (naive ones as UTC there)
    try:
        return parse_filter_time("TIME", text, naive_is_utc=False)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {shown(text)}") from None
    try:
        return as_int("--limit", value, 1)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_filter_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("bulk (without RUN_ID)")
    group.add_argument(
        "--status", action="append", default=None, help="runs in this status (repeatable)"
    )
    group.add_argument("--task", default=None, help="runs of this task id")
    group.add_argument("--queue", default=None, help="runs of this queue")
    group.add_argument(
        "--created-after", type=_timestamp, default=None, metavar="TIME", help="ISO 8601"
    )
    group.add_argument(
        "--created-before", type=_timestamp, default=None, metavar="TIME", help="ISO 8601"
    )
    group.add_argument("--limit", type=_count, default=None, metavar="N", help="at most N runs")
    group.add_argument(
        "--all", action="store_true", help="no filter: every run the action applies to"
    )
    group.add_argument("--dry-run", action="store_true", help="count the matching runs only")
    group.add_argument("--yes", action="store_true", help="act without asking")


def _filters(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "status": args.status,
        "task": args.task,
        "queue": args.queue,
        "created_after": args.created_after,
        "created_before": args.created_before,
        "limit": args.limit,
        "all": args.all,
    }


class _Progress:
    """``done of matched`` on stderr, rewritten at most ten times a second (a terminal).

    While acting, the first Ctrl-C (SIGINT) is held until the batch under way commits, so
    ``done`` is exactly what committed; a second one interrupts at once (``forced``: the
    batch under way may or may not have committed)."""

    def __init__(self, action: str) -> None:
        self.action = action
        self.done = 0
        self.matched = 0
        self.requested = False
        self.forced = False
        self._line = ProgressLine()
        self._previous: Any = None

    def __enter__(self) -> _Progress:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _interrupt(self, signum: int, frame: Any) -> None:
        if self.requested:
            self.forced = True
            raise KeyboardInterrupt
        self.requested = True

    def __call__(self, done: int, matched: int) -> None:
        self.done, self.matched = done, matched
        if self.requested:
            raise KeyboardInterrupt  # between two batches: every one so far committed
        self._line.show(f"runlane: {_VERB[self.action]} {done:,} of {matched:,}")

    def finish(self) -> None:
        self._line.finish()


def _act(runlane: Runlane, action: str, **filters: Any) -> BulkResult:
    method = {
        "retry": runlane.retry_runs,
        "cancel": runlane.cancel_runs,
        "delete": runlane.delete_runs,
    }[action]
    result: BulkResult = method(**filters)
    return result


def run_bulk(runlane: Runlane, action: str, args: argparse.Namespace) -> int:
    """Count, confirm, then act in batches; returns the exit code."""
    filters = _filters(args)
    counted = _act(runlane, action, dry_run=True, **filters)
    print(f"{count_of(counted.matched, 'run')} match{'es' if counted.matched == 1 else ''}")
    if args.dry_run or counted.matched == 0:
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigurationError(
                f"runs {action} by filter changes {count_of(counted.matched, 'run')}: pass --yes "
                "to confirm (or --dry-run to count only)"
            )
        answer = input(f"{action} {count_of(counted.matched, 'run')}? [y/N] ")
        if answer.strip().lower() not in {"y", "yes"}:
            print("nothing changed")
            return 0
    progress = _Progress(action)
    try:
        with progress:
            result = _act(runlane, action, on_batch=progress, reason=args.reason, **filters)
    except KeyboardInterrupt:
        progress.finish()
        done = f"at least {progress.done:,}" if progress.forced else f"{progress.done:,}"
        print(
            f"interrupted: {done} of {count_of(progress.matched or counted.matched, 'run')} "
            f"{_VERB[action]}; every finished batch is committed; run the same command again "
            "to finish"
        )
        return EXIT_INTERRUPTED
    progress.finish()
    print(f"{result.changed:,} of {count_of(result.matched, 'matching run')} {_VERB[action]}")
    return 0
