"""``runlane stats``: the per-minute rollup over a window, in buckets (``Runlane.stats``)."""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from typing import Any

from runlane._operator.bulk import parse_filter_time
from runlane.cli._target import TARGET_HELP, LoadApp, Target, add_target_options, target_runtime
from runlane.stats import BUCKETS, Histogram, Stats, StatsBucket

__all__ = ["add_stats_command", "format_stats"]

_FIGURES = ("triggered", "started", "completed", "failed", "retried", "cancelled")


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f}ms" if value < 1 else f"{value:.2f}s"


def _spread(name: str, histogram: Histogram) -> str:
    if not histogram.count:
        return f"{name} -"
    quantiles = (histogram.percentile(q) for q in (0.5, 0.95, 0.99))
    p50, p95, p99 = (_seconds(v) for v in quantiles)
    return f"{name} p50 {p50} p95 {p95} p99 {p99}"


def _line(label: str, bucket: StatsBucket) -> str:
    figures = "  ".join(f"{name} {getattr(bucket, name)}" for name in _FIGURES)
    return f"{label}  {figures}  {_spread('wait', bucket.wait)}  {_spread('run', bucket.run_time)}"


def format_stats(stats: Stats) -> list[str]:
    """The window, one line per bucket something happened in, and the totals."""
    scope = ", ".join(
        f"{name} {value}" for name, value in (("queue", stats.queue), ("task", stats.task)) if value
    )
    head = (
        f"{stats.environment}{' (' + scope + ')' if scope else ''}: "
        f"{stats.since:%Y-%m-%d %H:%M} to {stats.until:%Y-%m-%d %H:%M} UTC, "
        f"buckets of {int(stats.bucket.total_seconds() // 60)} min"
    )
    empty = StatsBucket
    lines = [
        _line(f"{b.start:%Y-%m-%d %H:%M}", b) for b in stats.buckets if b != empty(start=b.start)
    ]
    return [head, *lines, _line("total", stats.totals)]


def _moment(label: str, text: str | None) -> datetime | None:
    return None if text is None else parse_filter_time(label, text, naive_is_utc=True)


def _cmd_stats(load_app: LoadApp, args: argparse.Namespace) -> int:
    since = _moment("--since", args.since)  # checked before the runtime is made
    until = _moment("--until", args.until)
    runlane = target_runtime(Target(args.app, args), load_app)
    try:
        stats = runlane.stats(
            queue=args.queue, task=args.task, since=since, until=until, bucket=args.bucket
        )
    finally:
        runlane.close()
    if args.json:
        print(json.dumps(stats.to_dict(), indent=2))
    else:
        print("\n".join(format_stats(stats)), flush=True)
    return 0


def add_stats_command(commands: Any, load_app: LoadApp) -> None:
    stats = commands.add_parser(
        "stats", help="print the rollup of runs over time (per minute, hour, day)"
    )
    stats.add_argument("app", metavar="APP", nargs="?", default=None, help=TARGET_HELP)
    add_target_options(stats)
    stats.add_argument("--queue", help="one queue only")
    stats.add_argument("--task", help="one task id only")
    stats.add_argument(
        "--since", metavar="TIME", help="ISO 8601, UTC unless it gives an offset (default: 1 h ago)"
    )
    stats.add_argument("--until", metavar="TIME", help="ISO 8601 (default: now)")
    stats.add_argument(
        "--bucket",
        metavar="SIZE",
        help=f"one of {', '.join(BUCKETS)} (default: the smallest giving at most 200 buckets)",
    )
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.set_defaults(handler=lambda args: _cmd_stats(load_app, args))
