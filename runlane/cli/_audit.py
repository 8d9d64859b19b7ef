"""``runlane audit`` (the operators' audit trail, newest first) and ``runlane runs
reschedule`` (move a queued, delayed or retrying run's due time).

Every operator command of the CLI is recorded as the CLI's (``via`` ``cli``): the database
role it connects as and the user running it; ``--reason`` says why.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

from runlane._operator.bulk import parse_filter_time
from runlane.cli._operator import aligned, dump_json, using, when
from runlane.cli._target import TARGET_HELP, LoadApp, add_target_options, split_targets
from runlane.errors import ConfigurationError
from runlane.models import AuditRecord
from runlane.runtime import Runlane
from runlane.toolkit import as_int, shown

__all__ = ["add_audit_command", "add_reschedule_command", "reason_option"]

_HEADER = ("AT", "WHO", "VIA", "ACTION", "TARGET", "RUNS", "REASON")


def reason_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reason", default=None, help="why (at most 500 characters; kept in the audit trail)"
    )


def _plain(text: str) -> str:
    """``text`` as one line of a terminal: every character that is not printable (a
    newline, an escape sequence, a bidirectional override) shown as ``\\xNN`` or
    ``\\uNNNN``, and a backslash doubled, so a record written through raw SQL (or an OS
    user named oddly) forges no line and moves no cursor."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_escaped(c) for c in text)


def _escaped(c: str) -> str:
    if c == "\\":
        return "\\\\"
    if c.isprintable():
        return c
    code = ord(c)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _who(record: AuditRecord) -> str:
    user = record.actor or record.os_user or "-"
    return f"{_plain(user)} ({_plain(record.db_role)})"


def _runs(record: AuditRecord) -> str:
    if record.runs is None:
        return "changed" if record.changed else "unchanged"
    return str(record.runs)


def _audit(load_app: LoadApp, args: argparse.Namespace) -> int:
    since = (
        None if args.since is None else parse_filter_time("--since", args.since, naive_is_utc=True)
    )
    limit = as_int("--limit", _int(args.limit), 1, 1000)

    def use(runlane: Runlane) -> int:
        page = runlane.list_audit(since=since, limit=limit, cursor=args.cursor)
        if args.json:
            dump_json({"records": page.items, "next_cursor": page.next_cursor})
            return 0
        rows = [
            (
                when(r.at),
                _who(r),
                _plain(r.via),
                _plain(r.action),
                _plain(r.target or "-"),
                _runs(r),
                _plain(r.reason or ""),
            )
            for r in page.items
        ]
        if not rows:
            print("no operator actions recorded" + (" since then" if since else ""))
        else:
            print("\n".join(aligned(_HEADER, rows)))
        if page.next_cursor:
            print(f"more: runlane audit --cursor {page.next_cursor}")
        return 0

    return using(load_app, args, use)


def _int(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        return text  # as_int names it


def _reschedule(load_app: LoadApp, args: argparse.Namespace) -> int:
    args.app, run_ids = split_targets(args.targets, want_run_ids=True)
    if len(run_ids) != 1:
        raise ConfigurationError(
            f"give one RUN_ID (a UUID, as `runlane runs list` prints it), got {len(run_ids)}"
        )
    if args.at is not None and args.delay is not None:
        raise ConfigurationError("give --at or --in, not both (neither: now)")
    run_at = None
    if args.at is not None:
        run_at = parse_filter_time("--at", args.at, naive_is_utc=False)

    def use(runlane: Runlane) -> int:
        due = run_at
        if args.delay is not None:
            seconds = _seconds(args.delay)
            due = runlane.opened_storage().database_now() + timedelta(seconds=seconds)
        run = runlane.reschedule_run(run_ids[0], run_at=due, reason=args.reason)
        print(f"run {run.id} is {run.status.value}, due {when(run.due_at)}")
        return 0

    return using(load_app, args, use)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 100 * 365 * 86400:
        raise ConfigurationError(f"--in takes seconds from now (0 or more), got {shown(text)}")
    return value


def add_reschedule_command(actions: Any, load_app: LoadApp) -> None:
    """``runs reschedule`` on the ``runs`` command's sub-parsers."""
    parser = actions.add_parser(
        "reschedule", help="move a queued, delayed or retrying run's due time (default: now)"
    )
    parser.add_argument("targets", metavar="[APP] RUN_ID", nargs="+", help=TARGET_HELP)
    parser.add_argument("--at", default=None, help="the new due time, ISO 8601 with its offset")
    parser.add_argument("--in", dest="delay", default=None, metavar="SECONDS", help="due in")
    reason_option(parser)
    add_target_options(parser)
    parser.set_defaults(handler=lambda args: _reschedule(load_app, args))


def add_audit_command(commands: Any, load_app: LoadApp) -> None:
    parser = commands.add_parser(
        "audit", help="the operators' actions newest first: who, when, what, how many, why"
    )
    parser.add_argument("app", metavar="APP", nargs="?", default=None, help=TARGET_HELP)
    parser.add_argument("--since", default=None, help="only actions at or after this time")
    parser.add_argument("--limit", default="50", help="at most this many (1 to 1000)")
    parser.add_argument("--cursor", default=None, help="the next page, as printed")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    add_target_options(parser)
    parser.set_defaults(handler=lambda args: _audit(load_app, args))
