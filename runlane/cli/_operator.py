"""The operator commands: ``runlane queues list|pause|resume``, ``runlane workers`` and
``runlane schedules list|pause|resume|run``.

Each takes ``APP`` or ``--database-url`` (see :mod:`runlane.cli._target`); reads print aligned
text, or one JSON document with ``--json``; actions are idempotent and say what they did.
Registered on the ``runlane`` parser by :mod:`runlane.cli`.
"""

from __future__ import annotations

import argparse
import enum
import json
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import attrs

from runlane.cli._target import TARGET_HELP, LoadApp, Target, add_target_options, target_runtime
from runlane.flow import RateLimit
from runlane.models import QueueInfo, ScheduleInfo, WorkerInfo
from runlane.runtime import Runlane, acting_as

__all__ = [
    "add_operator_commands",
    "aligned",
    "dump_json",
    "format_workers",
    "plain",
    "using",
    "when",
]


def plain(value: Any) -> Any:
    """JSON-ready: attrs records as objects, datetimes in ISO 8601, UUIDs and enums as strings."""
    if attrs.has(type(value)):
        return plain(attrs.asdict(value, recurse=False))
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def dump_json(value: Any) -> None:
    print(json.dumps(plain(value), indent=2, ensure_ascii=False, default=str))


def when(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")


def aligned(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns padded to their widest cell; the last column is not padded."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


Item = TypeVar("Item")
# a table's columns: each one's header and how it shows an item
Columns = Sequence[tuple[str, Callable[[Item], str]]]


def _table(columns: Columns[Item], items: Sequence[Item]) -> list[str]:
    """``items`` as aligned rows under the columns' headers."""
    rows = [[cell(item) for _, cell in columns] for item in items]
    return aligned([header for header, _ in columns], rows)


def using(load_app: LoadApp, args: argparse.Namespace, use: Callable[[Runlane], int]) -> int:
    """Open the command's runtime (``APP`` or the URL options), run ``use``, close it."""
    runlane = target_runtime(Target(getattr(args, "app", None), args), load_app)
    try:
        with acting_as(None, via="cli"):  # the audit trail's "who"
            return use(runlane)
    finally:
        runlane.close()


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


# -- queues ---------------------------------------------------------------------------------


def _queue_state(q: QueueInfo) -> str:
    state = "paused" if q.paused else "running"
    return state + (f" ({q.paused_reason})" if q.paused and q.paused_reason else "")


def _count(*statuses: str) -> Callable[[QueueInfo], str]:
    return lambda q: str(sum(q.counts.get(status, 0) for status in statuses))


def _rate(limit: RateLimit) -> str:
    burst = "" if limit.burst is None else f" +{limit.burst}"
    return f"{limit.count}/{limit.per.total_seconds():g}s{burst}"


_QUEUE_COLUMNS: Columns[QueueInfo] = [
    ("QUEUE", lambda q: q.name + ("" if q.defined else " *")),
    ("STATE", _queue_state),
    ("QUEUED", _count("queued")),
    ("RUNNING", lambda q: str(q.running)),
    ("CLAIMED", lambda q: str(q.claimed)),
    ("RETRYING", _count("retrying", "released")),
    ("WAITING", _count("waiting")),
    ("LIMIT", lambda q: "-" if q.concurrency_limit is None else str(q.concurrency_limit)),
    ("RATE", lambda q: "-" if q.rate_limit is None else _rate(q.rate_limit)),
    ("PER KEY", lambda q: "-" if q.key_concurrency_limit is None else str(q.key_concurrency_limit)),
    ("OLDEST QUEUED", lambda q: _age(q.oldest_queued_age)),
]


def _queues_list(runlane: Runlane, args: argparse.Namespace) -> int:
    queues = runlane.list_queues()
    if args.json:
        dump_json(queues)
        return 0
    print("\n".join(_table(_QUEUE_COLUMNS, queues)))
    if any(not q.defined for q in queues):
        print("* known from the database only (no code of this runtime defines it)")
    return 0


def _queue_pause(runlane: Runlane, args: argparse.Namespace) -> int:
    runlane.pause_queue(args.queue, reason=args.reason)
    print(
        f"queue {args.queue!r} is paused: no attempt of it starts until "
        "`runlane queues resume`; running attempts finish, triggers are still accepted"
    )
    return 0


def _queue_resume(runlane: Runlane, args: argparse.Namespace) -> int:
    runlane.resume_queue(args.queue, reason=args.reason)
    print(f"queue {args.queue!r} is running: its queued runs are claimed again")
    return 0


# -- workers --------------------------------------------------------------------------------


_WORKER_COLUMNS: Columns[WorkerInfo] = [
    ("WORKER ID", lambda w: str(w.worker_id)),
    ("STATE", lambda w: w.state.value),
    ("HOST", lambda w: w.host),
    ("PID", lambda w: str(w.pid)),
    ("SLOTS", lambda w: str(w.concurrency)),
    ("QUEUES", lambda w: ",".join(w.queues)),
    ("STARTED", lambda w: when(w.started_at)),
    ("LAST SEEN", lambda w: when(w.last_seen_at)),
    ("VERSION", lambda w: w.runlane_version),
]


def format_workers(workers: Sequence[WorkerInfo]) -> list[str]:
    """The workers section of ``runlane status``."""
    if not workers:
        return ["workers", "  (no delivery worker is running)"]
    return ["workers", *(f"  {line}" for line in _table(_WORKER_COLUMNS, workers))]


def _workers(runlane: Runlane, args: argparse.Namespace) -> int:
    workers = runlane.list_workers(include_stopped=args.all)
    if args.json:
        dump_json(workers)
    elif not workers:
        print("no workers" + ("" if args.all else " running (--all shows stopped ones)"))
    else:
        print("\n".join(_table(_WORKER_COLUMNS, workers)))
    return 0


# -- schedules ------------------------------------------------------------------------------


_SCHEDULE_COLUMNS: Columns[ScheduleInfo] = [
    ("SCHEDULE", lambda s: s.id),
    ("STATE", lambda s: "paused" if s.paused else "active"),
    ("CRON", lambda s: s.cron),
    ("TIMEZONE", lambda s: s.timezone),
    ("TASK", lambda s: s.task_id or "-"),
    ("QUEUE", lambda s: s.queue or "-"),
    ("NEXT FIRE", lambda s: when(s.next_fire_at)),
    ("LAST FIRED", lambda s: when(s.last_fired_at)),
    ("LAST RUN", lambda s: "-" if s.last_run_id is None else str(s.last_run_id)),
]


def _schedules_list(runlane: Runlane, args: argparse.Namespace) -> int:
    schedules = runlane.list_schedules()
    if args.json:
        dump_json(schedules)
        return 0
    if not schedules:
        print("no schedules")
        return 0
    print("\n".join(_table(_SCHEDULE_COLUMNS, schedules)))
    return 0


def _schedule_pause(runlane: Runlane, args: argparse.Namespace) -> int:
    runlane.pause_schedule(args.schedule_id, reason=args.reason)
    print(f"schedule {args.schedule_id!r} is paused: it fires nothing until resumed")
    return 0


def _schedule_resume(runlane: Runlane, args: argparse.Namespace) -> int:
    runlane.resume_schedule(args.schedule_id, reason=args.reason)
    print(
        f"schedule {args.schedule_id!r} is active again from its next slot "
        "(missed slots are not caught up)"
    )
    return 0


def _schedule_run(runlane: Runlane, args: argparse.Namespace) -> int:
    handle = runlane.trigger_schedule_now(args.schedule_id, reason=args.reason)
    print(
        f"run {handle.id} triggered from schedule {args.schedule_id!r} "
        f"({handle.task_id} on queue {handle.queue})"
    )
    return 0


# -- the parser -----------------------------------------------------------------------------


Act = Callable[[Runlane, argparse.Namespace], int]


def _command(
    actions: Any, name: str, help_text: str, act: Act, load_app: LoadApp
) -> argparse.ArgumentParser:
    """A subcommand running ``act`` on the runtime its ``APP`` or URL options name."""
    parser: argparse.ArgumentParser = actions.add_parser(name, help=help_text)
    parser.add_argument("app", metavar="APP", nargs="?", default=None, help=TARGET_HELP)
    add_target_options(parser)
    parser.set_defaults(handler=lambda args: using(load_app, args, lambda rl: act(rl, args)))
    return parser


def add_operator_commands(commands: Any, load_app: LoadApp) -> None:
    """Add ``queues``, ``workers`` and ``schedules`` to ``commands``, the subparsers of the
    ``runlane`` parser."""
    queues = commands.add_parser("queues", help="list queues; pause or resume one")
    queue_actions = queues.add_subparsers(dest="queues_command", required=True, metavar="ACTION")
    listing = _command(
        queue_actions,
        "list",
        "every queue: state, runs by status, limit, oldest queued run",
        _queues_list,
        load_app,
    )
    listing.add_argument("--json", action="store_true", help="print one JSON document")
    pause = _command(
        queue_actions,
        "pause",
        "stop new attempts of a queue on every worker (running ones finish)",
        _queue_pause,
        load_app,
    )
    pause.add_argument("queue", metavar="QUEUE")
    pause.add_argument(
        "--reason", default=None, help="shown by `runlane queues list`, kept in the audit trail"
    )
    resume = _command(
        queue_actions,
        "resume",
        "let a paused queue's runs start again",
        _queue_resume,
        load_app,
    )
    resume.add_argument("queue", metavar="QUEUE")
    resume.add_argument("--reason", default=None, help="why (kept in the audit trail)")

    workers = _command(
        commands,
        "workers",
        "delivery workers: host, pid, queues, state (running, stopping, lost)",
        _workers,
        load_app,
    )
    workers.add_argument("--all", action="store_true", help="include stopped workers")
    workers.add_argument("--json", action="store_true", help="print one JSON document")

    schedules = commands.add_parser(
        "schedules", help="list schedules; pause, resume or run one now"
    )
    schedule_actions = schedules.add_subparsers(
        dest="schedules_command", required=True, metavar="ACTION"
    )
    listing = _command(
        schedule_actions,
        "list",
        "every stored schedule with its next fire time",
        _schedules_list,
        load_app,
    )
    listing.add_argument("--json", action="store_true", help="print one JSON document")
    for name, help_text, handler in (
        ("pause", "a paused schedule fires nothing", _schedule_pause),
        ("resume", "fire again from the next slot (no catching up)", _schedule_resume),
        ("run", "trigger the schedule's run now (its slots are left alone)", _schedule_run),
    ):
        parser = _command(schedule_actions, name, help_text, handler, load_app)
        parser.add_argument("schedule_id", metavar="SCHEDULE_ID")
        parser.add_argument("--reason", default=None, help="why (kept in the audit trail)")
