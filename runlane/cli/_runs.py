"""The ``runlane runs list|show|retry|cancel|delete`` and ``runlane trigger`` commands.

Every ``runs`` command takes ``APP`` or ``--database-url`` (:mod:`runlane.cli._target`);
``trigger`` needs ``APP``, whose task validates the payload.

Registered on the ``runlane`` parser by :mod:`runlane.cli`; errors are raised as runlane
errors and printed there as one line (a bad argument, an invalid payload or an unknown task
exits 2, a run that is not found or in the wrong status exits 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from runlane._codec import MAX_DEPTH
from runlane.cli._audit import add_reschedule_command, reason_option
from runlane.cli._bulk import add_filter_options, run_bulk
from runlane.cli._operator import dump_json, using, when
from runlane.cli._options import seconds
from runlane.cli._target import TARGET_HELP, LoadApp, add_target_options, split_targets
from runlane.errors import ConfigurationError, PayloadValidationError, TaskNotFound
from runlane.models import AttemptRecord, RunHistory, RunSnapshot, RunStatus
from runlane.runtime import Runlane

__all__ = ["add_run_commands"]

# -- runs list ---------------------------------------------------------------------------------


def _table(runs: tuple[RunSnapshot, ...]) -> list[str]:
    header = ("RUN ID", "TASK", "QUEUE", "STATUS", "ATTEMPTS", "CREATED")
    rows = [
        (
            str(r.id),
            r.task_id,
            r.queue,
            r.status.value,
            spent_of(r),
            when(r.created_at),
        )
        for r in runs
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def _list(load_app: LoadApp, args: argparse.Namespace) -> int:
    contains = (
        None
        if args.payload_contains is None
        else _payload(args.payload_contains, "--payload-contains")
    )
    search: dict[str, Any] = {
        "task_prefix": args.task_prefix,
        "queue_prefix": args.queue_prefix,
        "idempotency_key": args.idempotency_key,
        "payload_contains": contains,
    }
    if args.search_seconds is not None:
        search["search_seconds"] = args.search_seconds

    def use(runlane: Runlane) -> int:
        page = runlane.list_runs(
            status=args.status,
            task=args.task,
            queue=args.queue,
            limit=args.limit,
            cursor=args.cursor,
            **search,
        )
        if args.json:
            dump_json(page)
            return 0
        if not page.runs:
            print("no runs")
        else:
            print("\n".join(_table(page.runs)))
        if page.searched_to is not None:
            print(
                f"the search stopped early: it looked at runs created down to "
                f"{when(page.searched_to)}"
            )
        if page.next_cursor is not None:
            print(f"more: --cursor {page.next_cursor}")
        return 0

    return using(load_app, args, use)


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


def spent_of(run: RunSnapshot) -> str:
    """``spent/max_attempts``: the attempts counted against the budget (the one counting rule
    of ``runs list``, ``runs show`` and ``runs retry``; docs/architecture.md)."""
    return f"{run.attempts_spent}/{run.max_attempts}"


def _attempts_text(history: RunHistory) -> str:
    """``1 of 3 spent (2 left); latest #2; 1 handed back unspent``."""
    run = history.run
    left = max(0, run.max_attempts - run.attempts_spent)
    parts = [f"{run.attempts_spent} of {run.max_attempts} spent ({left} left)"]
    if run.attempt:
        parts.append(f"latest #{run.attempt}")
    handed_back = sum(a.outcome in _UNSPENT for a in history.attempts)
    if handed_back:
        parts.append(f"{handed_back} handed back unspent")
    return "; ".join(parts)


# attempt outcomes that spend nothing of the budget: handed back (shutdown, release) or
# suspended (a durable wait)
_UNSPENT = frozenset({"released", "suspended"})


def _show_text(history: RunHistory) -> None:
    run = history.run
    fields = [
        ("run", str(run.id)),
        ("task", run.task_id),
        ("queue", run.queue),
        ("status", run.status.value),
        ("attempts", _attempts_text(history)),
        ("priority", str(run.priority)),
        ("idempotency key", run.idempotency_key or "-"),
        ("parent run", "-" if run.parent_run_id is None else str(run.parent_run_id)),
        ("created", when(run.created_at)),
        ("due", when(run.due_at)),
        ("started", when(run.started_at)),
        ("finished", when(run.finished_at)),
        ("payload", json.dumps(run.payload, ensure_ascii=False)),
        ("output", json.dumps(run.output, ensure_ascii=False)),
    ]
    if run.error is not None:
        fields.append(("error", f"{run.error.type}: {run.error.message}"))
    if run.progress is not None:
        fields.append(("progress", _progress_text(run.progress)))
    for label, value in fields:
        print(f"{label:<16} {value}")
    if run.error is not None and run.error.traceback:
        print("traceback")
        for line in run.error.traceback.rstrip("\n").splitlines():
            print(f"  {line}")
    print("attempts")
    if not history.attempts:
        print("  (none finished)")
    for a in history.attempts:
        error = "" if a.error is None else f"  {a.error.type}: {a.error.message}"
        took = (a.finished_at - a.started_at).total_seconds()
        print(
            f"  #{a.number:<3} {a.outcome:<10} {when(a.started_at)}  {took:.3f}s{_ran_by(a)}{error}"
        )
    print("steps")
    if not history.steps:
        print("  (none stored)")
    for s in history.steps:
        output = json.dumps(s.output, ensure_ascii=False)
        print(f"  {s.name}  (attempt {s.attempt}, {when(s.created_at)})  {output}")


def _one_run(args: argparse.Namespace) -> str:
    """``[APP] RUN_ID``: sets ``args.app``, returns the run id."""
    args.app, run_ids = split_targets(args.targets, want_run_ids=True)
    if len(run_ids) != 1:
        raise ConfigurationError(
            f"give one RUN_ID (a UUID, as `runlane runs list` prints it), got {len(run_ids)}"
        )
    return run_ids[0]


def _show(load_app: LoadApp, args: argparse.Namespace) -> int:
    run_id = _one_run(args)

    def use(runlane: Runlane) -> int:
        history = runlane.get_run_history(run_id)
        if args.json:
            dump_json(history)
        else:
            _show_text(history)
        return 0

    return using(load_app, args, use)


# -- runs retry, runs cancel --------------------------------------------------------------------


def _retry_one(runlane: Runlane, run_id: str, reason: str | None) -> None:
    run = runlane.retry_run(run_id, reason=reason)
    print(
        f"run {run.id} is queued again with a fresh budget: attempts "
        f"{spent_of(run)} (its next attempt is numbered #{run.attempt + 1})"
    )


def _cancel_one(runlane: Runlane, run_id: str, reason: str | None) -> None:
    result = runlane.cancel(run_id, reason=reason)
    if not result.changed:
        print(f"run {result.run_id} is {result.status.value}: nothing to cancel")
    elif result.status is RunStatus.CANCELLATION_REQUESTED:
        print(
            f"run {result.run_id}: cancellation requested; its handler is asked to stop "
            "and the run ends cancelled when it does"
        )
    else:
        print(f"run {result.run_id}: {result.previous.value} -> {result.status.value}")


_ONE: dict[str, Callable[[Runlane, str, str | None], None]] = {
    "retry": _retry_one,
    "cancel": _cancel_one,
}
_FILTERS = ("status", "task", "queue", "created_after", "created_before", "limit")


def _action(load_app: LoadApp, action: str, args: argparse.Namespace) -> int:
    """``runs retry|cancel [APP] RUN_ID...`` acts on those runs; without RUN_ID, on every
    run the filters match (see :mod:`runlane.cli._bulk`); ``runs delete`` only by filter."""
    args.app, run_ids = split_targets(args.targets, want_run_ids=action in _ONE)
    filtered = args.all or any(getattr(args, name) is not None for name in _FILTERS)
    if run_ids and (filtered or args.dry_run):
        raise ConfigurationError(
            "give RUN_IDs or filters (--status, --task, ...), not both: RUN_IDs act on those "
            "runs alone"
        )
    if not run_ids and not filtered:
        raise ConfigurationError(
            f"runs {action} needs "
            + ("RUN_IDs, or " if action in _ONE else "")
            + "filters (--status, --task, --queue, --created-after, --created-before, "
            "--limit), or --all for every run it applies to"
        )

    def use(runlane: Runlane) -> int:
        if not run_ids:
            return run_bulk(runlane, action, args)
        for run_id in run_ids:
            _ONE[action](runlane, run_id, args.reason)
        return 0

    return using(load_app, args, use)


# -- trigger -------------------------------------------------------------------------------------


def _payload(text: str, option: str = "--payload") -> Any:
    """``--payload`` (or ``option``) parsed as JSON; what json.loads cannot take is a
    ConfigurationError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"{option} is not valid JSON: {exc}") from exc
    except RecursionError:  # json.loads recurses once per level
        raise ConfigurationError(
            f"{option} is nested too deeply to parse; payloads may nest at most {MAX_DEPTH} "
            "levels: flatten it"
        ) from None
    except ValueError:  # the only one json.loads raises: an integer too long to convert
        raise ConfigurationError(
            f"{option} holds an integer of more than {sys.get_int_max_str_digits()} digits, "
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

    return using(load_app, args, use)


def add_run_commands(commands: Any, load_app: LoadApp) -> None:
    """Add ``runs`` (with list, show, retry, cancel) and ``trigger`` to ``commands``, the
    subparsers of the ``runlane`` parser."""
    app_help = "module:attribute naming a Runlane"
    runs = commands.add_parser(
        "runs", help="list and inspect runs; retry, cancel or delete one or many"
    )
    actions = runs.add_subparsers(dest="runs_command", required=True, metavar="ACTION")

    listing = actions.add_parser("list", help="runs newest first, a page at a time")
    listing.add_argument("app", metavar="APP", nargs="?", default=None, help=TARGET_HELP)
    listing.add_argument(
        "--status",
        help=f"only runs in this status ({', '.join(s.value for s in RunStatus)})",
    )
    listing.add_argument("--task", help="only runs of this task id")
    listing.add_argument("--queue", help="only runs of this queue")
    listing.add_argument("--task-prefix", help="only runs whose task id starts with this")
    listing.add_argument("--queue-prefix", help="only runs whose queue starts with this")
    listing.add_argument("--idempotency-key", help="only runs triggered with this key")
    listing.add_argument(
        "--payload-contains",
        metavar="JSON",
        help="only runs whose payload contains this JSON object (jsonb @>)",
    )
    listing.add_argument(
        "--search-seconds",
        type=seconds,
        default=None,
        metavar="S",
        help="a search's budget of database time (default 1); it says when it stopped early",
    )
    listing.add_argument(
        "--limit", type=int, default=50, help="runs per page, 1 to 1000 (default 50)"
    )
    listing.add_argument("--cursor", help="the next page, as printed after the previous one")
    listing.add_argument("--json", action="store_true", help="print one JSON document")
    add_target_options(listing)
    listing.set_defaults(handler=lambda args: _list(load_app, args))

    show = actions.add_parser("show", help="a run with its attempts and stored steps")
    show.add_argument("targets", metavar="[APP] RUN_ID", nargs="+", help=TARGET_HELP)
    show.add_argument("--json", action="store_true", help="print one JSON document")
    add_target_options(show)
    show.set_defaults(handler=lambda args: _show(load_app, args))

    for action, help_text in (
        ("retry", "queue failed or cancelled runs again with a fresh attempt budget"),
        ("cancel", "cancel runs (running ones are asked to stop)"),
        ("delete", "delete terminal runs by filter (parents keep tombstones, as cleanup does)"),
    ):
        parser = actions.add_parser(action, help=help_text)
        parser.add_argument(
            "targets",
            metavar="[APP] RUN_ID..." if action in _ONE else "[APP]",
            nargs="*",
            help=TARGET_HELP
            + ("; RUN_IDs act on those runs, none on the filters" if action in _ONE else ""),
        )
        add_filter_options(parser)
        reason_option(parser)
        add_target_options(parser)
        parser.set_defaults(handler=lambda args, action=action: _action(load_app, action, args))
    add_reschedule_command(actions, load_app)

    trigger = commands.add_parser(
        "trigger", help="trigger a run; the payload is validated like Runlane.trigger()"
    )
    trigger.add_argument("app", metavar="APP", help=app_help)
    trigger.add_argument("task_id", metavar="TASK_ID")
    trigger.add_argument(
        "--payload", required=True, metavar="JSON", help="the payload as JSON (e.g. '{\"a\": 1}')"
    )
    trigger.add_argument(
        "--delay", type=seconds, default=None, metavar="S", help="seconds until it is due"
    )
    trigger.add_argument("--queue", default=None, metavar="Q", help="a queue other than the task's")
    trigger.set_defaults(handler=lambda args: _trigger(load_app, args))
