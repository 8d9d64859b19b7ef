"""What the benchmark commands share: the server, fresh schemas, the no-op task, waiting for
runs to finish, percentiles, the RSS of a process, and the table they print."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import attrs
import psycopg

from runlane import RunContext, Runlane, Task, create_runlane, task
from runlane.postgres import apply_postgres_storage_migrations, postgres_polling_lane
from runlane.testing import start_embedded_postgres

__all__ = [
    "CONCURRENCY",
    "Row",
    "add_database_argument",
    "fresh_schema",
    "limit_row",
    "log",
    "noop",
    "pct",
    "postgres_cpu_seconds",
    "print_table",
    "ratio_row",
    "rss_kib",
    "runtime",
    "server_url",
    "timed",
    "wait_drained",
    "wait_until_zero",
]

CONCURRENCY = 8


@task(id="bench.noop")
def noop(payload: Any, context: RunContext) -> None:
    return None


def runtime(
    url: str,
    schema: str,
    poll: timedelta = timedelta(milliseconds=200),
    *,
    tasks: Sequence[Task[Any, Any]] = (noop,),
    **options: Any,
) -> Runlane:
    """A runtime on the polling lane polling every ``poll``, with ``tasks`` (the no-op task
    by default) and ``options`` (more ``create_runlane`` keywords)."""
    lane = postgres_polling_lane(connection_string=url, schema=schema, poll_interval=poll)
    return create_runlane(lane=lane, tasks=tasks, **options)


def fresh_schema(url: str) -> str:
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    apply_postgres_storage_migrations(connection_string=url, schema=schema)
    return schema


def wait_until_zero(
    url: str, count_sql: str, *, interval: float, timeout: float, what: str
) -> None:
    """Poll ``count_sql`` (one count) every ``interval`` seconds until it is 0, over one
    connection opened first (a connection per poll cost a backend start and a handshake each
    time, partly on the measured process's GIL: 7% of its samples in a profile of the
    RabbitMQ lane's processing); TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            row = conn.execute(count_sql, prepare=True).fetchone()
            if row is not None and int(row[0]) == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not finish")
            time.sleep(interval)


def wait_drained(url: str, schema: str, timeout: float = 600) -> None:
    """Wait until no run is left: runs not finished yet are counted through the small
    partial indexes (queued, running), so polling does not scan the whole table while the
    measurement runs."""
    wait_until_zero(
        url,
        f"select (select count(*) from {schema}.runs where environment = 'default' "
        "and status = 'queued' and due_at > '-infinity') "
        f"+ (select count(*) from {schema}.runs where environment = 'default' "
        "and status in ('running', 'cancellation_requested'))",
        interval=0.05,
        timeout=timeout,
        what="runs",
    )


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rss_kib() -> int:
    """This process's resident set size (VmRSS of /proc/self/status), in KiB."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS line in /proc/self/status")


def log(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def add_database_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        default=os.environ.get("RUNLANE_BENCH_DATABASE_URL"),
        help="an existing PostgreSQL (default: a throw-away embedded-postgres server)",
    )


@contextlib.contextmanager
def server_url(database_url: str | None) -> Iterator[str]:
    """The given URL, else a throw-away embedded server removed afterwards."""
    if database_url is not None:
        yield database_url
        return
    url, server = start_embedded_postgres()
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute("show server_version").fetchone()
        log(f"embedded PostgreSQL {row[0] if row else '?'} at {url}")
        yield url
    finally:
        server.cleanup()


@attrs.frozen
class Row:
    """One line of a table: a runlane figure, the floor it is compared with, and the target."""

    measure: str
    value: float | None
    fmt: str = ",.0f"
    floor_label: str = ""
    floor: float | None = None
    ratio: float | None = None
    target: str = ""
    met: bool | None = None


def ratio_row(
    measure: str,
    value: float,
    floor_label: str,
    floor: float,
    minimum: float | None,
    *,
    fmt: str = ",.0f",
) -> Row:
    """A row whose ratio value/floor is held against ``minimum`` (None: no target)."""
    ratio = value / floor if floor else 0.0
    return Row(
        measure=measure,
        value=value,
        fmt=fmt,
        floor_label=floor_label,
        floor=floor,
        ratio=ratio,
        target="" if minimum is None else f">= {minimum:g}x",
        met=None if minimum is None else ratio >= minimum,
    )


def limit_row(
    measure: str,
    value: float,
    maximum: float | None,
    unit: str,
    *,
    floor_label: str = "",
    floor: float | None = None,
) -> Row:
    """A row whose value (e.g. a latency) must stay at or under ``maximum`` (None: no
    target); a floor, when given, is shown beside it with the ratio value/floor."""
    return Row(
        measure=measure,
        value=value,
        fmt=",.2f",
        floor_label=floor_label,
        floor=floor,
        ratio=value / floor if floor else None,
        target="" if maximum is None else f"<= {maximum:g} {unit}",
        met=None if maximum is None else value <= maximum,
    )


def postgres_cpu_seconds() -> float | None:
    """CPU seconds (user + system) used so far by the processes of this machine named
    ``postgres`` (the server and its backends), from /proc; None where /proc is not readable.
    A backend that exits between two readings takes its share with it, so read around a
    measure whose connections stay open."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
                text = stat.read()
        except OSError:  # exited meanwhile
            continue
        name, _, rest = text.partition(" (")[2].rpartition(") ")
        if name != "postgres":
            continue
        fields = rest.split()
        total += int(fields[11]) + int(fields[12])
    return total / ticks


def _cell(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def print_table(rows: list[Row], notes: Sequence[str] = (), compare: str = "floor") -> None:
    """Print ``rows`` as a Markdown table (to paste into benchmarks/README.md); ``compare``
    names the column of what each figure is compared with."""
    header = ("measure", "runlane", compare, "value", "ratio", "target", "met")
    cells = [
        (
            r.measure,
            _cell(r.value, r.fmt),
            r.floor_label,
            _cell(r.floor, r.fmt),
            "" if r.ratio is None else f"{r.ratio:.2f}",
            r.target,
            "" if r.met is None else ("met" if r.met else "NOT MET"),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    right = {1, 3, 4}

    def line(values: tuple[str, ...]) -> str:
        parts = [
            v.rjust(w) if i in right else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return "| " + " | ".join(parts) + " |"

    print()
    print(line(header))
    print("| " + " | ".join("-" * w for w in widths) + " |")
    for c in cells:
        print(line(c))
    for note in notes:
        print(f"note: {note}")
    sys.stdout.flush()


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started
