"""The executor every repository of the Postgres storage runs its statements through.

It owns the connections (a shared pool, or one dedicated connection: ``_connections.py``),
the schema's named statements (and those sent through libpq, ``_pq.py``), the reconnect
retries, the schema check on first use, the maintenance fence, and the one boundary where
driver errors become runlane errors: a connection that cannot be had or broke (once the
retries are spent) raises :class:`~runlane.StorageUnavailable`, any other database error a
:class:`~runlane.RunlaneError`, a closed storage :class:`~runlane.RunlaneClosed`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import psycopg

from runlane.errors import (
    ConfigurationError,
    IncompatibleSchema,
    RunlaneClosed,
    RunlaneError,
    SchemaNotMigrated,
    StaleLease,
)
from runlane.postgres._batches import too_large, too_large_reason
from runlane.postgres._compat import LedgerRow, check_runtime_ledger
from runlane.postgres._connections import (
    Conn,
    ConnectionSource,
    DedicatedSource,
    connection_failed,
    connection_lost,
    storage_error,
)
from runlane.postgres._migrations import known_checksums
from runlane.postgres._now import Clock, now_cursor
from runlane.postgres._pooler import Pooling
from runlane.postgres._pq import RawStatement
from runlane.postgres._sql import statements
from runlane.storage import MaintenanceFence
from runlane.toolkit import Backoff, Deadline

__all__ = ["FIRST_PAGE", "Executor"]

#: The keyset (created time, id) above every row: where a newest-first walk starts.
FIRST_PAGE = ("infinity", uuid.UUID(int=2**128 - 1))

log = logging.getLogger("runlane.postgres")

T = TypeVar("T")

#: Sent through libpq directly (postgres/_pq.py): group commit's shared inserts
#: (sql/group.sql) and a single run's insert on a pool connection (sql/runs.sql)
_RAW_STATEMENTS = (
    "run_insert_group",
    "run_insert_group_fresh",
    "run_insert_group_claimed",
    "run_insert_group_claimed_fresh",
    "run_insert_one",
    "run_insert_one_fresh",
)

# Retries of a statement whose connection broke (server restart, terminated backend): three,
# after about 50 ms, 250 ms and 1 s (the shared back-off, jittered)
_RECONNECT_TRIES = 3


def _migrate_hint(schema: str) -> str:
    return (
        f"run `runlane migrate --database-url URL --schema {schema}` (or "
        f"runlane.postgres.apply_postgres_storage_migrations(connection_string=..., "
        f"schema={schema!r})) as a deployment step before starting the application"
    )


class _Shared:
    """What a storage and its dedicated views share: the schema's statements, the clock
    they read as now (_now.py), whether the connections go through a pooler (_pooler.py),
    and whether the schema was found current."""

    def __init__(self, schema: str, clock: Clock | None, pooling: Pooling) -> None:
        self.pooling = pooling
        self.sql = statements(schema)
        self.raw = {name: RawStatement(name, self.sql[name], clock) for name in _RAW_STATEMENTS}
        self.cursor = now_cursor(clock)
        self.checked = False


class Executor:
    """Runs a repository's function on a connection of ``source`` (see the module
    docstring); ``dedicated()`` makes one on a connection of its own, sharing the
    statements and the schema check."""

    def __init__(
        self,
        *,
        conninfo: str,
        schema: str,
        source: ConnectionSource,
        connect_timeout: float,
        statement_timeout: float | None,
        clock: Clock | None = None,
        pooling: Pooling | None = None,
        _shared: _Shared | None = None,
    ) -> None:
        self.schema = schema
        self.conninfo = conninfo
        self.connect_timeout = connect_timeout
        # of dedicated views' statements: a statement blocked longer than this fails
        self.statement_timeout = statement_timeout
        self._source = source
        self._shared = _shared or _Shared(schema, clock, pooling or Pooling())
        self.sql, self.raw = self._shared.sql, self._shared.raw
        self._lock = threading.Lock()
        self._opened = False
        self._closed = False
        # while close() lets a drain (the eager publisher) finish: its records still reach
        # the database, every other call is refused
        self._draining = False

    def dedicated(self, name: str, *, synchronous_commit: bool) -> Executor:
        source = DedicatedSource(
            self.conninfo,
            timeout=self.connect_timeout,
            name=name,
            synchronous_commit=synchronous_commit,
            statement_timeout=self.statement_timeout,
            pooling=self._shared.pooling,
        )
        return Executor(
            conninfo=self.conninfo,
            schema=self.schema,
            source=source,
            connect_timeout=self.connect_timeout,
            statement_timeout=self.statement_timeout,
            _shared=self._shared,
        )

    # -- lifecycle -----------------------------------------------------------------------

    def open(self) -> None:
        """Connect; idempotent. A failed open leaves it re-openable."""
        with self._lock:
            if self._closed:
                raise self.closed_error()
            if self._opened:
                return
            try:
                self._source.open()
            except psycopg.Error as exc:
                raise storage_error(
                    exc,
                    self.conninfo,
                    "connect to the database",
                    connect_timeout=self.connect_timeout,
                ) from exc
            self._opened = True

    def close(
        self, timeout: float | None, drain: Callable[[float | None], None] | None = None
    ) -> None:
        """Close the connections within ``timeout``; first ``drain(seconds left)`` when the
        executor was opened, whose own statements (``run(..., draining=True)``) still run."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            drain = drain if self._opened else None
            self._draining = drain is not None
        deadline = Deadline(timeout)
        try:
            if drain is not None:
                drain(deadline.left())
        finally:
            self._draining = False
        self._source.close(deadline.left())

    def interrupt(self) -> None:
        self._source.interrupt()

    def lock_scope(self, environment: str) -> str:
        """The scope of a queue's claim lock (``queue_claim_lock``): claimers of one queue of
        one environment in this schema serialise on it."""
        return f"runlane:{self.schema}:{environment}"

    def closed_error(self) -> RunlaneClosed:
        return RunlaneClosed(
            f"this runlane storage (schema {self.schema!r}) was closed: call start() on the "
            "runtime to open it again, or build a new runtime"
        )

    # -- statements ----------------------------------------------------------------------

    def run(self, fn: Callable[[Conn], T], *, draining: bool = False) -> T:
        """``fn`` on a connection, repeated a few times when the connection itself broke.

        Every caller's statement is safe to repeat: inserts carry client-made ids and
        ``on conflict do nothing``, fenced writes reject a second application, and a claim
        whose answer was lost only leaves leases that expire and are recovered. ``draining``:
        a record of the eager publisher's, which close() lets through while it finishes.
        """
        if not self._opened or (self._closed and not (draining and self._draining)):
            self.open()
        backoff = Backoff(first=0.05, cap=1.0, factor=5.0)
        for retries_left in range(_RECONNECT_TRIES, -1, -1):
            try:
                with self._source.connection() as conn:
                    conn.cursor_factory = self._shared.cursor
                    self._check_schema(conn)
                    return fn(conn)
            except psycopg.OperationalError as exc:
                if not retries_left or not connection_lost(exc) or self._closed:
                    raise self._error(exc) from exc
            except psycopg.Error as exc:
                raise self._error(exc) from exc
            delay = backoff.next()
            log.warning("runlane: database connection lost; retrying in %.2fs", delay)
            time.sleep(delay)
        raise AssertionError("unreachable")

    def fenced(self, fence: MaintenanceFence | None, fn: Callable[[Conn], T]) -> T:
        """``fn`` in a transaction that first checks the band's lease is still current."""

        def run(conn: Conn) -> T:
            if fence is None:
                return fn(conn)
            with conn.transaction():
                held = conn.execute(self.sql["maintenance_fence"], attrs.asdict(fence)).fetchone()
                if held is None:
                    raise StaleLease(
                        f"maintenance lease of band {fence.band!r} (fencing {fence.fencing}) is "
                        "no longer held by this replica; another replica owns the band now"
                    )
                return fn(conn)

        return self.run(run)

    def on_callers(self, connection: object, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """``fn`` on the caller's connection (``trigger(connection=...)``), in its
        transaction; the schema checked first on a pool connection."""
        if not isinstance(connection, psycopg.Connection):
            raise ConfigurationError(
                f"connection= takes a psycopg.Connection, got {type(connection).__name__}"
            )
        if not self._shared.checked:
            self.run(lambda conn: None)
        factory, connection.cursor_factory = connection.cursor_factory, self._shared.cursor
        try:
            return fn(connection)
        except psycopg.Error as exc:
            raise self._translation(exc) or storage_error(
                exc, self.conninfo, "insert runs on the caller's connection (connection=)"
            ) from exc
        finally:
            connection.cursor_factory = factory

    # -- errors --------------------------------------------------------------------------

    def _check_schema(self, conn: Conn) -> None:
        if self._shared.checked:
            return
        # a missing table is turned into SchemaNotMigrated by _error, like any statement's
        rows = [
            LedgerRow(int(version), str(name), str(checksum), compatibility)
            for version, name, checksum, compatibility in conn.execute(
                self.sql["schema_version"]
            ).fetchall()
        ]
        # a newer schema whose newer migrations are all additive is accepted (expand/contract)
        note = check_runtime_ledger(
            rows, known_checksums(), self.schema, _migrate_hint(self.schema)
        )
        if note is not None:
            log.info("runlane: %s", note)
        self._shared.checked = True

    def _translation(self, exc: psycopg.Error) -> RunlaneError | None:
        """The error naming the migrate step (or the grant) that "relation does not exist"
        and friends become, or the value too large to store; None for any other."""
        if isinstance(exc, psycopg.errors.UndefinedTable | psycopg.errors.InvalidSchemaName):
            return SchemaNotMigrated(
                f"runlane's tables are missing from schema {self.schema!r} "
                f"({exc.diag.message_primary}): {_migrate_hint(self.schema)}"
            )
        if isinstance(exc, psycopg.errors.UndefinedColumn | psycopg.errors.UndefinedFunction):
            return IncompatibleSchema(
                f"schema {self.schema!r} does not match this runlane "
                f"({exc.diag.message_primary}): {_migrate_hint(self.schema)}"
            )
        if too_large(exc):  # a step's or a wait token's output (triggers say which payload)
            return ConfigurationError(f"the value is {too_large_reason(exc)}")
        if isinstance(exc, psycopg.errors.InsufficientPrivilege):
            return ConfigurationError(
                f"the database role runlane connects as lacks a privilege this needs in schema "
                f"{self.schema!r} ({exc.diag.message_primary}): connect as a role granted this "
                f"job (`runlane grant JOB ROLE --schema {self.schema}`; see docs/security.md)"
            )
        return None

    def _error(self, exc: psycopg.Error) -> RunlaneError:
        """The runlane error a driver error becomes (the one boundary where that happens)."""
        translated = self._translation(exc)
        if translated is not None:
            return translated
        if self._closed and connection_failed(exc):
            return self.closed_error()
        return storage_error(
            exc, self.conninfo, f"use schema {self.schema!r}", connect_timeout=self.connect_timeout
        )
