"""The ``runlane runs list|show|retry|cancel`` and ``runlane trigger`` commands.

Registered on the ``runlane`` parser by :mod:`runlane.cli`; errors are raised as runlane
errors and printed there as one line (a bad argument, an invalid payload or an unknown task
exits 2, a run that is not found or in the wrong status exits 1).
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

import attrs

from runlane._codec import MAX_DEPTH
from runlane._display import shown
from runlane.errors import ConfigurationError, PayloadValidationError, TaskNotFound
from runlane.models import AttemptRecord, RunHistory, RunSnapshot, RunStatus
from runlane.runtime import Runlane

__all__ = ["add_run_commands"]

LoadApp = Callable[[str], Runlane]


def _plain(value: Any) -> Any:
    """JSON-ready: datetimes in ISO 8601, UUIDs and enums as strings."""
    if attrs.has(type(value)):
        return _plain(attrs.asdict(value, recurse=False))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def _dump(value: Any) -> None:
    print(json.dumps(_plain(value), indent=2, ensure_ascii=False))


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")


def _using(load_app: LoadApp, spec: str, use: Callable[[Runlane], int]) -> int:
    runlane = load_app(spec)
    try:
        return use(runlane)
    finally:
        runlane.close()


# -- runs list ---------------------------------------------------------------------------------


def _table(runs: tuple[RunSnapshot, ...]) -> list[str]:
    header = ("RUN ID", "TASK", "QUEUE", "STATUS", "ATTEMPT", "CREATED")
    rows = [
        (
            str(r.id),
            r.task_id,
            r.queue,
            r.status.value,
            f"{r.attempt}/{r.max_attempts}",
            _when(r.created_at),
        )
        for r in runs
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def _list(load_app: LoadApp, args: argparse.Namespace) -> int:
    def use(runlane: Runlane) -> int:
        page = runlane.list_runs(
            status=args.status,
            task=args.task,
            queue=args.queue,
            limit=args.limit,
            cursor=args.cursor,
        )
        if args.json:
            _dump(page)
            return 0
        if not page.runs:
            print("no runs")
        else:
            print("\n".join(_table(page.runs)))
        if page.next_cursor is not None:
            print(f"more: --cursor {page.next_cursor}")
        return 0

    return _using(load_app, args.app, use)


# -- runs show ---------------------------------------------------------------------------------


def _ran_by(attempt: AttemptRecord) -> str:
    """Who ran an attempt: its worker's host and id (the host only while the worker's row is
    kept; nothing for an attempt of drain or of a release before workers were recorded)."""
    if attempt.worker_id is None:
        return ""
    host = "" if attempt.host is None else f" on {attempt.host}"
    return f"{host} (worker {attempt.worker_id})"


def _progress_text(progress: Any) -> str:
    """The last ``report_progress``: ``40% copying part 2 {"part": 2}``."""
    fraction, message, data = (progress.get(k) for k in ("fraction", "message", "data"))
    parts = [] if fraction is None else [f"{fraction:.0%}"]
    parts += [] if message is None else [message]
    parts += [] if data is None else [json.dumps(data, ensure_ascii=False)]
    return " ".join(parts) or "-"


def _show_text(history: RunHistory) -> None:
    run = history.run
    fields = [
        ("run", str(run.id)),
        ("task", run.task_id),
        ("queue", run.queue),
        ("status", run.status.value),
        ("attempt", f"{run.attempt} (max_attempts {run.max_attempts})"),
        ("priority", str(run.priority)),
        ("idempotency key", run.idempotency_key or "-"),
        ("parent run", "-" if run.parent_run_id is None else str(run.parent_run_id)),
        ("created", _when(run.created_at)),
        ("due", _when(run.due_at)),
        ("started", _when(run.started_at)),
        ("finished", _when(run.finished_at)),
        ("payload", json.dumps(run.payload, ensure_ascii=False)),
        ("output", json.dumps(run.output, ensure_ascii=False)),
    ]
    if run.error is not None:
        fields.append(("error", f"{run.error.type}: {run.error.message}"))
    if run.progress is not None:
        fields.append(("progress", _progress_text(run.progress)))
    for label, value in fields:
        print(f"{label:<16} {value}")
    print("attempts")
    if not history.attempts:
        print("  (none finished)")
    for a in history.attempts:
        error = "" if a.error is None else f"  {a.error.type}: {a.error.message}"
        took = (a.finished_at - a.started_at).total_seconds()
        print(
            f"  #{a.number:<3} {a.outcome:<10} {_when(a.started_at)}  {took:.3f}s"
            f"{_ran_by(a)}{error}"
        )
    print("steps")
    if not history.steps:
        print("  (none stored)")
    for s in history.steps:
        output = json.dumps(s.output, ensure_ascii=False)
        print(f"  {s.name}  (attempt {s.attempt}, {_when(s.created_at)})  {output}")


def _show(load_app: LoadApp, args: argparse.Namespace) -> int:
    def use(runlane: Runlane) -> int:
        history = runlane.get_run_history(args.run_id)
        if args.json:
            _dump(history)
        else:
            _show_text(history)
        return 0

    return _using(load_app, args.app, use)


# -- runs retry, runs cancel --------------------------------------------------------------------


def _retry(load_app: LoadApp, args: argparse.Namespace) -> int:
    def use(runlane: Runlane) -> int:
        run = runlane.retry_run(args.run_id)
        print(
            f"run {run.id} is queued again (next attempt #{run.attempt + 1}, "
            f"up to {run.max_attempts} more)"
        )
        return 0

    return _using(load_app, args.app, use)


def _cancel(load_app: LoadApp, args: argparse.Namespace) -> int:
    def use(runlane: Runlane) -> int:
        result = runlane.cancel(args.run_id)
        if not result.changed:
            print(f"run {result.run_id} is {result.status.value}: nothing to cancel")
        elif result.status is RunStatus.CANCELLATION_REQUESTED:
            print(
                f"run {result.run_id}: cancellation requested; its handler is asked to stop "
                "and the run ends cancelled"
            )
        else:
            print(f"run {result.run_id}: {result.previous.value} -> {result.status.value}")
        return 0

    return _using(load_app, args.app, use)


# -- trigger -------------------------------------------------------------------------------------


def _payload(text: str) -> Any:
    """``--payload`` parsed as JSON; what json.loads cannot take is a ConfigurationError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"--payload is not valid JSON: {exc}") from exc
    except RecursionError:  # json.loads recurses once per level
        raise ConfigurationError(
            f"--payload is nested too deeply to parse; payloads may nest at most {MAX_DEPTH} "
            "levels: flatten it"
        ) from None
    except ValueError:  # the only one json.loads raises: an integer too long to convert
        raise ConfigurationError(
            f"--payload holds an integer of more than {sys.get_int_max_str_digits()} digits, "
            "more than Python converts; send such a number as a string"
        ) from None


def _trigger(load_app: LoadApp, args: argparse.Namespace) -> int:
    payload = _payload(args.payload)

    def use(runlane: Runlane) -> int:
        try:
            handle = runlane.trigger(args.task_id, payload, delay=args.delay, queue=args.queue)
        except (PayloadValidationError, TaskNotFound) as exc:
            raise ConfigurationError(str(exc)) from exc
        if handle.created:
            print(f"run {handle.id} triggered ({handle.task_id} on queue {handle.queue})")
        else:
            print(f"run {handle.id} already exists ({handle.task_id} on queue {handle.queue})")
        return 0

    return _using(load_app, args.app, use)


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {shown(text)}") from None


def add_run_commands(commands: Any, load_app: LoadApp) -> None:
    """Add ``runs`` (with list, show, retry, cancel) and ``trigger`` to ``commands``, the
    subparsers of the ``runlane`` parser."""
    app_help = "module:attribute naming a Runlane"
    runs = commands.add_parser("runs", help="list and inspect runs, retry or cancel one")
    actions = runs.add_subparsers(dest="runs_command", required=True, metavar="ACTION")

    listing = actions.add_parser("list", help="runs newest first, a page at a time")
    listing.add_argument("app", metavar="APP", help=app_help)
    listing.add_argument(
        "--status",
        help=f"only runs in this status ({', '.join(s.value for s in RunStatus)})",
    )
    listing.add_argument("--task", help="only runs of this task id")
    listing.add_argument("--queue", help="only runs of this queue")
    listing.add_argument(
        "--limit", type=int, default=50, help="runs per page, 1 to 1000 (default 50)"
    )
    listing.add_argument("--cursor", help="the next page, as printed after the previous one")
    listing.add_argument("--json", action="store_true", help="print one JSON document")
    listing.set_defaults(handler=lambda args: _list(load_app, args))

    show = actions.add_parser("show", help="a run with its attempts and stored steps")
    show.add_argument("app", metavar="APP", help=app_help)
    show.add_argument("run_id", metavar="RUN_ID")
    show.add_argument("--json", action="store_true", help="print one JSON document")
    show.set_defaults(handler=lambda args: _show(load_app, args))

    retry = actions.add_parser(
        "retry", help="queue a failed or cancelled run again with a fresh attempt budget"
    )
    retry.add_argument("app", metavar="APP", help=app_help)
    retry.add_argument("run_id", metavar="RUN_ID")
    retry.set_defaults(handler=lambda args: _retry(load_app, args))

    cancel = actions.add_parser("cancel", help="cancel a run (a running one is asked to stop)")
    cancel.add_argument("app", metavar="APP", help=app_help)
    cancel.add_argument("run_id", metavar="RUN_ID")
    cancel.set_defaults(handler=lambda args: _cancel(load_app, args))

    trigger = commands.add_parser(
        "trigger", help="trigger a run; the payload is validated like Runlane.trigger()"
    )
    trigger.add_argument("app", metavar="APP", help=app_help)
    trigger.add_argument("task_id", metavar="TASK_ID")
    trigger.add_argument(
        "--payload", required=True, metavar="JSON", help="the payload as JSON (e.g. '{\"a\": 1}')"
    )
    trigger.add_argument(
        "--delay", type=_seconds, default=None, metavar="S", help="seconds until it is due"
    )
    trigger.add_argument("--queue", default=None, metavar="Q", help="a queue other than the task's")
    trigger.set_defaults(handler=lambda args: _trigger(load_app, args))
