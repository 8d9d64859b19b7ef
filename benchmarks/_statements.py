"""What a run costs the database: the statements this process sends, the WAL written, the
server's CPU.

On a real network each statement is a round trip (several pipelined ones share one, which
runlane does only for batches split across statements), so statements per run decide
throughput at 1 ms RTT more than anything measured on loopback. The count wraps psycopg's
``Cursor.execute`` and ``Cursor.executemany`` (``Connection.execute`` goes through the
former), and the round trips of the statements runlane sends through libpq directly (group
commit's shared insert and its preparation: ``postgres/_pq.RawStatement``), for as long as
the context is open, in every thread of the process: the worker's
claims, completions and lease extensions, the triggers, the listener's ``LISTEN``. It sees
only this process's statements, not those of worker processes it starts.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import psycopg

from benchmarks._common import Row
from runlane.postgres._pq import RawStatement

__all__ = [
    "PerRun",
    "StatementCount",
    "counting_statements",
    "server_cpu_seconds",
    "wal_position",
]


class StatementCount:
    """Statements sent since the context opened; ``per`` divides a stretch by its runs."""

    def __init__(self, skipped: int | None) -> None:
        self._lock = threading.Lock()
        self._skipped = skipped
        self.value = 0

    def add(self) -> None:
        if threading.get_ident() == self._skipped:
            return
        with self._lock:
            self.value += 1

    def per(self, runs: int, since: int = 0) -> float:
        """Statements per run since the reading ``since``."""
        return (self.value - since) / runs if runs else 0.0


@contextlib.contextmanager
def counting_statements(*, skip_this_thread: bool = False) -> Iterator[StatementCount]:
    """Count every statement psycopg sends in this process while open; with
    ``skip_this_thread``, not those of the calling thread (a benchmark's own polling)."""
    count = StatementCount(threading.get_ident() if skip_this_thread else None)

    def counted(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            count.add()
            return method(self, *args, **kwargs)

        return call

    # what sends a statement (RawStatement: each round trip, its preparation included)
    methods = [
        (psycopg.Cursor, "execute"),
        (psycopg.Cursor, "executemany"),
        (RawStatement, "_execute"),
        (RawStatement, "_prepare"),
    ]
    originals = [(cls, name, getattr(cls, name)) for cls, name in methods]
    for cls, name, method in originals:
        setattr(cls, name, counted(method))
    try:
        yield count
    finally:
        for cls, name, method in originals:
            setattr(cls, name, method)


def wal_position(url: str) -> int:
    """The server's current WAL position in bytes: the difference of two readings is the
    WAL written between them (by everything on that server)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("select (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint").fetchone()
    assert row is not None
    return int(row[0])


def server_cpu_seconds(url: str) -> float | None:
    """CPU seconds (user + system) the server at ``url`` has used: its postmaster's, its
    live children's, and those of children that exited (the postmaster's waited-for
    children's times), from /proc; None when the server runs elsewhere or /proc is not
    readable. Unlike summing every process named postgres, other servers on the machine
    do not count."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "select pid from pg_stat_activity where backend_type = 'checkpointer'"
        ).fetchone()
    if row is None:
        return None
    try:
        postmaster = _stat(int(row[0]))[1]  # the checkpointer's parent
        ticks = os.sysconf("SC_CLK_TCK")
        fields, _ = _stat(postmaster)
        total = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
        for pid in (int(name) for name in os.listdir("/proc") if name.isdigit()):
            try:
                child, parent = _stat(pid)
            except OSError:  # exited meanwhile
                continue
            if parent == postmaster:
                total += int(child[11]) + int(child[12])
    except OSError:
        return None
    return total / ticks


def _stat(pid: int) -> tuple[list[str], int]:
    """The fields of /proc/<pid>/stat after the command name, and the parent's pid."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
        text = stat.read()
    fields = text.rpartition(") ")[2].split()
    return fields, int(fields[1])


@attrs.frozen
class PerRun:
    """What a run cost the database: statements sent (round trips on a real network), WAL
    bytes written and the server's CPU microseconds (None when not readable)."""

    statements: float
    wal_bytes: float
    server_us: float | None

    @classmethod
    def between(
        cls, url: str, runs: int, statements: float, wal_before: int, cpu_before: float | None
    ) -> PerRun:
        cpu_after = server_cpu_seconds(url)
        server = (
            None if cpu_before is None or cpu_after is None else (cpu_after - cpu_before) / runs
        )
        wal = (wal_position(url) - wal_before) / runs
        return cls(statements, wal, None if server is None else server * 1e6)

    def rows(self, what: str) -> list[Row]:
        rows = [
            Row(f"  statements per run, {what}", self.statements, ",.3f"),
            Row(f"  WAL bytes per run, {what}", self.wal_bytes, ",.0f"),
        ]
        if self.server_us is not None:
            rows.append(Row(f"  Postgres CPU us per run, {what}", self.server_us, ",.1f"))
        return rows
