"""The Postgres implementation of the storage contract."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

import attrs
import psycopg
from psycopg.rows import TupleRow, dict_row, tuple_row

from runlane.errors import (
    ConfigurationError,
    IncompatibleSchema,
    RunlaneClosed,
    RunlaneError,
    SchemaNotMigrated,
    StaleLease,
)
from runlane.models import (
    ResolvedTokenStatus,
    RunError,
    RunSnapshot,
    RunStatus,
    WaitToken,
    WaitTokenStatus,
)
from runlane.postgres._batches import (
    pipelined,
    refusing_too_large,
    split_runs,
    too_large,
    too_large_reason,
)
from runlane.postgres._bulk import BulkMethods
from runlane.postgres._compat import LedgerRow, check_runtime_ledger
from runlane.postgres._connections import (
    DEFAULT_CONNECT_TIMEOUT,
    Conn,
    ConnectionSource,
    DedicatedSource,
    PoolSource,
    check_conninfo,
    connection_failed,
    connection_lost,
    storage_error,
)
from runlane.postgres._flow import FlowMethods
from runlane.postgres._group import GroupCommit, group_row, group_rows, groupable
from runlane.postgres._inspect import InspectMethods
from runlane.postgres._migrations import known_checksums
from runlane.postgres._outbox import EagerPublisher, OutboxMethods
from runlane.postgres._pq import RawStatement
from runlane.postgres._queues import QueueMethods, status_queues
from runlane.postgres._schedules import ScheduleMethods
from runlane.postgres._sql import notify_channel, statements, validate_schema_name
from runlane.postgres._web_reads import WebReadMethods
from runlane.postgres._workers import WorkerMethods
from runlane.storage import (
    ClaimedRun,
    Completion,
    Expiration,
    ExpiredAttempt,
    Failure,
    FailureApplied,
    InsertedRun,
    LeaseRef,
    MaintenanceFence,
    MaintenanceLeaseRow,
    NewRuns,
    OutputRefused,
    PruneResult,
    StepStored,
    SuspendResult,
    WorkerBeat,
)
from runlane.toolkit import Backoff, Deadline

__all__ = ["PostgresStorage", "notify_channel"]

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

log = logging.getLogger("runlane.postgres")

T = TypeVar("T")

# Retries of a statement whose connection broke (server restart, terminated backend): three,
# after about 50 ms, 250 ms and 1 s (the shared back-off, jittered)
_RECONNECT_TRIES = 3
# what close() gives the transport lane's publisher without a timeout of its caller
_EAGER_CLOSE_SECONDS = 10.0


def _migrate_hint(schema: str) -> str:
    return (
        f"run `runlane migrate --database-url URL --schema {schema}` (or "
        f"runlane.postgres.apply_postgres_storage_migrations(connection_string=..., "
        f"schema={schema!r})) as a deployment step before starting the application"
    )


class _SchemaGate:
    """Remembers, for a storage and its dedicated views, that the schema was found current."""

    def __init__(self) -> None:
        self.checked = False


class PostgresStorage(
    FlowMethods,
    OutboxMethods,
    InspectMethods,
    BulkMethods,
    QueueMethods,
    WorkerMethods,
    ScheduleMethods,
    WebReadMethods,
):
    """Storage in one Postgres schema.

    The runtime's instance borrows connections from a psycopg pool; ``dedicated()`` makes a
    view of the same storage bound to one connection of its own, for a thread that must not
    wait on the pool (a worker slot, the lifecycle writer).

    No driver exception leaves a method: a connection that cannot be had or broke (once the
    reconnect retries are spent) raises :class:`~runlane.StorageUnavailable`, any other
    database error a :class:`~runlane.RunlaneError`; a closed storage raises
    :class:`~runlane.RunlaneClosed`.
    """

    def __init__(
        self,
        *,
        connection_string: str,
        schema: str,
        pool_min_size: int = 1,
        pool_max_size: int = 10,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        statement_timeout: float | None = 60.0,
        _source: ConnectionSource | None = None,
        _gate: _SchemaGate | None = None,
        _eager: EagerPublisher | None = None,
    ) -> None:
        self.schema = validate_schema_name(schema)
        check_conninfo(connection_string)
        self._sql = statements(schema)
        # the trigger statements sent past psycopg's cursor layer (_pq)
        self._raw = {name: RawStatement(name, self._sql[name]) for name in _RAW_STATEMENTS}
        self._conninfo = connection_string
        self._connect_timeout = connect_timeout
        # of dedicated views' statements: a statement blocked longer than this fails
        self._statement_timeout = statement_timeout
        self._source: ConnectionSource = _source or PoolSource(
            connection_string,
            min_size=pool_min_size,
            max_size=pool_max_size,
            name=f"runlane-{schema}",
            timeout=connect_timeout,
        )
        self._gate = _gate or _SchemaGate()
        # a transport lane's publisher: triggers store their items claimed and hand them over
        self._eager: EagerPublisher | None = _eager
        self._owns_eager = False  # the storage it was attached to closes it
        self._group = GroupCommit(self._insert_direct, self._insert_together)
        self._eager_group = GroupCommit(self._insert_eager_alone, self._insert_eager_together)
        self._lock = threading.Lock()
        self._opened = False
        self._closed = False
        # while close() lets the publisher finish: its records of what it published still
        # reach the database, every other call is refused
        self._draining = False

    @property
    def connection_string(self) -> str:
        return self._conninfo

    # -- lifecycle -----------------------------------------------------------------------

    def open(self) -> None:
        """Connect (the pool's minimum connections); idempotent. A failed open leaves the
        storage closed but re-openable: the next call tries again from scratch."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if self._opened:
                return
            try:
                self._source.open()
            except psycopg.Error as exc:
                raise storage_error(
                    exc,
                    self._conninfo,
                    "connect to the database",
                    connect_timeout=self._connect_timeout,
                ) from exc
            self._opened = True

    def close(self, timeout: float | None = None) -> None:
        """Close the connections; the transport lane's publisher first, which publishes
        what eager triggers handed over; both within ``timeout`` together (None: the
        publisher's own 10 s, the pool's own 5 s for its threads)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            eager = self._eager if self._owns_eager and self._opened else None
            self._draining = eager is not None
        deadline = Deadline(timeout)
        try:
            if eager is not None:
                # publishes what eager triggers handed over, first, and records it: the
                # storage refuses new calls but its records (_with_conn(..., draining=True))
                eager.close(_EAGER_CLOSE_SECONDS if timeout is None else deadline.left())
        finally:
            self._draining = False
        self._source.close(deadline.left())

    @property
    def eager_publisher(self) -> EagerPublisher | None:
        """The transport lane's publisher attached to this storage, if any."""
        return self._eager

    def interrupt(self) -> None:
        """Cancel the statement in flight on a dedicated view's connection (called from
        another thread, e.g. by close at its deadline); the blocked call then raises
        :class:`~runlane.StorageUnavailable`. A no-op when idle, and on the pooled storage."""
        self._source.interrupt()

    def _closed_error(self) -> RunlaneClosed:
        return RunlaneClosed(
            f"this runlane storage (schema {self.schema!r}) was closed: call start() on the "
            "runtime to open it again, or build a new runtime"
        )

    def dedicated(self, name: str, *, synchronous_commit: bool = True) -> PostgresStorage:
        """A view of this storage on one connection of its own, for one thread.

        ``synchronous_commit=False`` lets commits return before their WAL is flushed; only
        claims use it: a claim lost to a server crash only makes its run claimable again."""
        source = DedicatedSource(
            self._conninfo,
            timeout=self._connect_timeout,
            name=name,
            synchronous_commit=synchronous_commit,
            statement_timeout=self._statement_timeout,
        )
        return PostgresStorage(
            connection_string=self._conninfo,
            schema=self.schema,
            connect_timeout=self._connect_timeout,
            statement_timeout=self._statement_timeout,
            _source=source,
            _gate=self._gate,
            _eager=self._eager,
        )

    def attach_eager_publisher(self, publisher: EagerPublisher) -> None:
        """Triggers without ``connection=`` store their outbox items already claimed and
        hand them to ``publisher`` after commit (a transport lane calls this). Closing
        this storage closes the publisher; dedicated views share it."""
        self._eager = publisher
        self._owns_eager = True

    # -- plumbing ------------------------------------------------------------------------

    def _translation(self, exc: psycopg.Error) -> RunlaneError | None:
        """The error naming the migrate step (or the grant) that "relation does not exist"
        and friends become, or the value too large to store; None for any other driver
        error."""
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

    def _check_schema(self, conn: Conn) -> None:
        if self._gate.checked:
            return
        # a missing table is turned into SchemaNotMigrated by _error, like any statement's
        rows = [
            LedgerRow(int(version), str(name), str(checksum), compatibility)
            for version, name, checksum, compatibility in conn.execute(
                self._sql["schema_version"]
            ).fetchall()
        ]
        # a newer schema whose newer migrations are all additive is accepted (expand/contract)
        hint = _migrate_hint(self.schema)
        note = check_runtime_ledger(rows, known_checksums(), self.schema, hint)
        if note is not None:
            log.info("runlane: %s", note)
        self._gate.checked = True

    def _error(self, exc: psycopg.Error) -> RunlaneError:
        """The runlane error a driver error becomes (the one boundary where that happens)."""
        translated = self._translation(exc)
        if translated is not None:
            return translated
        if self._closed and connection_failed(exc):
            return self._closed_error()
        return storage_error(
            exc,
            self._conninfo,
            f"use schema {self.schema!r}",
            connect_timeout=self._connect_timeout,
        )

    def _with_conn(self, fn: Callable[[Conn], T], *, draining: bool = False) -> T:
        """Run ``fn`` on a connection, retrying a few times when the connection itself broke.

        Every caller's statement is safe to repeat: inserts carry client-made ids and
        ``on conflict do nothing``, fenced writes reject a second application, and a claim
        whose answer was lost only leaves leases that expire and are recovered. Driver
        errors leave as runlane errors (see the class docstring). ``draining``: a record of
        the eager publisher's, which close() lets through while the publisher finishes.
        """
        if not self._opened or (self._closed and not (draining and self._draining)):
            self.open()
        backoff = Backoff(first=0.05, cap=1.0, factor=5.0)
        for retries_left in range(_RECONNECT_TRIES, -1, -1):
            try:
                with self._source.connection() as conn:
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

    # -- runs ----------------------------------------------------------------------------

    def _insert_params(
        self, runs: NewRuns, *, one: bool = False, keyed: bool = True
    ) -> dict[str, Any]:
        """Parameters of the run_insert statements: one row's when ``one``, else arrays;
        idempotency keys only when ``keyed`` (the "fresh" statements take none).

        A batch's payloads go as one JSON array (each is JSON text already, so joining them
        is the whole encoding) and its ids as one array literal (uuid text needs no
        escaping): element-by-element array dumping cost more than the rest of a
        ``trigger_many`` call in Python."""
        params = {
            "environment": runs.environment,
            "task_id": runs.task_id,
            "queue": runs.queue,
            "priority": runs.priority,
            "max_attempts": runs.max_attempts,
            "parent_run_id": runs.parent_run_id,
            "run_at": runs.run_at,
            "delay_seconds": runs.delay.total_seconds(),
            "trace_context": runs.trace_context,
            "concurrency_key": runs.concurrency_key,
        }
        if one:
            params["id"] = runs.ids[0]
            params["payload"] = runs.payloads[0]
            if keyed:
                params["idempotency_key"] = runs.idempotency_keys[0]
        else:
            params["ids"] = _array_literal(runs.ids)
            params["payloads"] = "[" + ",".join(runs.payloads) + "]"
            if keyed:
                params["idempotency_keys"] = list(runs.idempotency_keys)
        return params

    def _claimed_rows(self, rows: Sequence[tuple[Any, ...]]) -> list[ClaimedRun]:
        return _claimed(rows)

    def _resolve_inserted(
        self, conn: Conn, runs: NewRuns, inserted: set[uuid.UUID]
    ) -> list[InsertedRun]:
        """The handles of ``runs``, of which the insert returned ``inserted``: the others met
        an idempotency key (or, retried after a lost answer, their own ids)."""
        if len(inserted) == len(runs.ids):
            return [InsertedRun(id=i, queue=runs.queue, created=True) for i in runs.ids]
        with conn.cursor(row_factory=tuple_row) as cur:
            return self._resolve_conflicts(cur, runs, inserted)

    def run_insert_many(self, runs: NewRuns, *, connection: Any = None) -> list[InsertedRun]:
        if connection is None and runs.concurrency_key is None and groupable(runs):
            # concurrent triggers share a statement
            group = self._group if self._eager is None else self._eager_group
            return group.insert(runs)
        if connection is None and self._eager is not None:
            return self._insert_eager(runs, self._eager)
        return self._insert_direct(runs, connection)

    def _insert_together(
        self,
        groups: Sequence[NewRuns],
        rows: str | None = None,
        committed: Callable[[], None] | None = None,
    ) -> list[list[InsertedRun]]:
        """The runs of several trigger() calls in one statement and one commit (_group); each
        call's handles, in order. ``rows``: the calls' rows made already (group_rows);
        ``committed`` is called once the statement has committed."""
        params = {"rows": group_rows([group_row(r) for r in groups]) if rows is None else rows}
        keyed = any(key is not None for runs in groups for key in runs.idempotency_keys)

        def insert(conn: Conn) -> list[list[InsertedRun]]:
            inserted: set[uuid.UUID] | None = None  # None: every run written by this statement
            if keyed:
                rows = self._raw["run_insert_group"].rows(conn, params)
                inserted = {uuid.UUID(row[0]) for row in rows if row[0] is not None}
            else:
                # without keys nothing can conflict: no conflict handling, no ids sent back
                try:
                    self._raw["run_insert_group_fresh"].rows(conn, params)
                except psycopg.errors.UniqueViolation:
                    # repeated after its first answer was lost: its runs are there
                    # (autocommit, so this failure undid nothing); read them back
                    inserted = set()
            if committed is not None:
                committed()
            return self._group_handles(conn, groups, inserted)

        return self._with_conn(insert)

    def _insert_one(self, runs: NewRuns) -> list[InsertedRun]:
        """One run on a pool connection (a lone trigger, a call of a failed group, a run too
        large to group): run_insert_one's statement through libpq (postgres/_pq.py), which
        costs less Python than a cursor."""
        keyed = runs.idempotency_keys[0] is not None
        params = self._insert_params(runs, one=True, keyed=keyed)

        def insert(conn: Conn) -> list[InsertedRun]:
            if keyed:
                rows = self._raw["run_insert_one"].rows(conn, params)
                return self._resolve_inserted(conn, runs, {uuid.UUID(r[0]) for r in rows if r[0]})
            try:
                self._raw["run_insert_one_fresh"].rows(conn, params)
            except psycopg.errors.UniqueViolation:
                # retried after its first answer was lost: its run is there (autocommit, so
                # this failure undid nothing); read it back
                return self._resolve_inserted(conn, runs, set())
            return [InsertedRun(id=runs.ids[0], queue=runs.queue, created=True)]

        return self._with_conn(lambda conn: refusing_too_large(insert, conn, runs))

    def _group_handles(
        self, conn: Conn, groups: Sequence[NewRuns], inserted: set[uuid.UUID] | None
    ) -> list[list[InsertedRun]]:
        """Each call's handles after a shared insert that wrote ``inserted`` (None: all of
        them); the runs it did not write met an idempotency key (maybe another call's of
        the group), or the group was retried after its answer was lost: read back."""
        made = []
        for runs in groups:
            if inserted is None or inserted.issuperset(runs.ids):
                made.append([InsertedRun(id=i, queue=runs.queue, created=True) for i in runs.ids])
            else:
                with conn.cursor(row_factory=tuple_row) as cur:
                    made.append(self._resolve_conflicts(cur, runs, inserted))
        return made

    def _insert_direct(self, runs: NewRuns, connection: Any = None) -> list[InsertedRun]:
        """``runs`` in statements of their own (on the caller's connection, if given)."""
        pieces = split_runs(runs)
        if len(pieces) > 1:
            return self._insert_split(runs, pieces, connection)
        one = len(runs.ids) == 1
        if one and connection is None:
            return self._insert_one(runs)
        keyed = any(key is not None for key in runs.idempotency_keys)
        params = self._insert_params(runs, one=one, keyed=keyed)
        if keyed:
            statement = self._sql["run_insert_one" if one else "run_insert_many"]
        else:
            # without keys nothing can conflict: no conflict handling, no ids sent back
            statement = self._sql["run_insert_one_fresh" if one else "run_insert_many_fresh"]
        created = [InsertedRun(id=i, queue=runs.queue, created=True) for i in runs.ids]

        def insert(conn: psycopg.Connection[Any]) -> list[InsertedRun]:
            with conn.cursor(row_factory=tuple_row) as cur:
                if not keyed:
                    try:
                        cur.execute(statement, params)
                    except psycopg.errors.UniqueViolation:
                        if connection is not None:
                            raise
                        # this statement was retried after its first answer was lost: the
                        # runs it wrote are there (autocommit, so this failure undid nothing)
                        return self._resolve_conflicts(cur, runs, set())
                    return created
                cur.execute(statement, params)
                inserted = {row[0] for row in cur.fetchall()}
            return self._resolve_inserted(conn, runs, inserted)

        return self._run_insert(insert, runs, connection)

    def _insert_split(
        self, runs: NewRuns, pieces: Sequence[NewRuns], connection: Any
    ) -> list[InsertedRun]:
        """A batch too large for one statement: one statement per piece, in one transaction
        and one round trip (see _batches); the statement for keys, whose conflict handling
        also covers a retry after a lost answer."""

        def insert(conn: psycopg.Connection[Any]) -> list[InsertedRun]:
            params = [self._insert_params(piece) for piece in pieces]
            rows = pipelined(conn, self._sql["run_insert_many"], params)
            return self._resolve_inserted(conn, runs, {row[0] for row in rows})

        return self._run_insert(insert, runs, connection)

    def _run_insert(
        self, insert: Callable[[Conn], list[InsertedRun]], runs: NewRuns, connection: Any
    ) -> list[InsertedRun]:
        """``insert`` on a pool connection, or on the caller's (``connection=``)."""
        if connection is None:
            return self._with_conn(lambda conn: refusing_too_large(insert, conn, runs))
        if not isinstance(connection, psycopg.Connection):
            raise ConfigurationError(
                f"connection= takes a psycopg.Connection, got {type(connection).__name__}"
            )
        if not self._gate.checked:
            self._with_conn(lambda conn: None)  # checks the schema on a pool connection
        try:
            return refusing_too_large(insert, connection, runs)
        except psycopg.Error as exc:
            raise self._translation(exc) or storage_error(
                exc, self._conninfo, "insert runs on the caller's connection (connection=)"
            ) from exc

    def _resolve_conflicts(
        self, cur: psycopg.Cursor[TupleRow], runs: NewRuns, inserted: set[uuid.UUID]
    ) -> list[InsertedRun]:
        cur.execute(
            self._sql["run_find_existing"],
            {
                "environment": runs.environment,
                "task_id": runs.task_id,
                "ids": [i for i in runs.ids if i not in inserted],
                "idempotency_keys": [k for k in runs.idempotency_keys if k is not None],
            },
        )
        by_id: dict[uuid.UUID, str] = {}
        by_key: dict[str, tuple[uuid.UUID, str]] = {}
        for run_id, key, queue_name in cur.fetchall():
            by_id[run_id] = queue_name
            if key is not None:
                by_key[key] = (run_id, queue_name)
        result = []
        for run_id, key in zip(runs.ids, runs.idempotency_keys, strict=True):
            if run_id in inserted:
                result.append(InsertedRun(id=run_id, queue=runs.queue, created=True))
            elif run_id in by_id:
                # a statement retried after a lost answer finds the row it wrote
                result.append(InsertedRun(id=run_id, queue=by_id[run_id], created=True))
            elif key is not None and key in by_key:
                existing_id, existing_queue = by_key[key]
                result.append(InsertedRun(id=existing_id, queue=existing_queue, created=False))
            else:
                raise RuntimeError(
                    f"run {run_id} was neither inserted nor found afterwards; runlane needs "
                    "the read committed isolation level for trigger(connection=...)"
                )
        return result

    def _snapshot_row(self, row: dict[str, Any]) -> RunSnapshot:
        return _snapshot(row)

    def run_get(self, environment: str, run_id: uuid.UUID) -> RunSnapshot | None:
        def get(conn: Conn) -> dict[str, Any] | None:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["run_get"], {"id": run_id, "environment": environment})
                return cur.fetchone()

        row = self._with_conn(get)
        return None if row is None else _snapshot(row)

    def run_get_many(
        self, environment: str, run_ids: Sequence[uuid.UUID]
    ) -> dict[uuid.UUID, RunSnapshot]:
        params = {"ids": list(run_ids), "environment": environment}

        def get(conn: Conn) -> dict[uuid.UUID, RunSnapshot]:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["run_get_many"], params)
                return {row["id"]: _snapshot(row) for row in cur.fetchall()}

        return self._with_conn(get)

    def run_claim(
        self,
        environment: str,
        queues: Sequence[str],
        limit: int,
        lease: timedelta,
        *,
        worker_id: uuid.UUID | None = None,
    ) -> list[ClaimedRun]:
        params = {
            "environment": environment,
            "queues": list(queues),
            "limit": limit,
            "lease_seconds": lease.total_seconds(),
            "concurrency_limit": None,
            "worker_id": worker_id,
        }
        return self._with_conn(
            lambda conn: _claimed(conn.execute(self._sql["run_claim"], params).fetchall())
        )

    def run_claim_bounded(
        self,
        environment: str,
        queue: str,
        concurrency_limit: int,
        limit: int,
        lease: timedelta,
        *,
        worker_id: uuid.UUID | None = None,
    ) -> list[ClaimedRun]:
        params = {
            "environment": environment,
            "queue": queue,
            "queues": [queue],
            "concurrency_limit": concurrency_limit,
            "limit": limit,
            "lease_seconds": lease.total_seconds(),
            "worker_id": worker_id,
            "lock_scope": f"runlane:{self.schema}:{environment}",
        }

        def claim(conn: Conn) -> list[ClaimedRun]:
            # two statements, one transaction: the count must come after the lock
            with conn.transaction():
                conn.execute(self._sql["queue_claim_lock"], params)
                return _claimed(conn.execute(self._sql["run_claim"], params).fetchall())

        return self._with_conn(claim)

    def run_complete_many(self, completions: Sequence[Completion]) -> set[uuid.UUID]:
        if not completions:
            return set()
        params = {
            "ids": _array_literal(c.run_id for c in completions),
            "attempts": _array_literal(c.attempt for c in completions),
            "lease_tokens": _array_literal(c.lease_token for c in completions),
            "outputs": "[" + ",".join(c.output for c in completions) + "]",
        }

        def complete(conn: Conn) -> set[uuid.UUID]:
            try:
                return {row[0] for row in conn.execute(self._sql["run_complete_many"], params)}
            except psycopg.Error as exc:
                if too_large(exc):
                    raise OutputRefused(exc.diag.message_primary) from exc
                raise

        return self._with_conn(complete)

    def run_fail_many(self, failures: Sequence[Failure]) -> list[FailureApplied]:
        if not failures:
            return []
        params = {
            "ids": [f.run_id for f in failures],
            "attempts": [f.attempt for f in failures],
            "lease_tokens": [f.lease_token for f in failures],
            "errors": [f.error for f in failures],
            "retry_delay_seconds": [
                None if f.retry_delay is None else f.retry_delay.total_seconds() for f in failures
            ],
        }

        def fail(conn: Conn) -> list[FailureApplied]:
            rows = conn.execute(self._sql["run_fail_many"], params).fetchall()
            return [FailureApplied(run_id=row[0], status=RunStatus(row[1])) for row in rows]

        return self._with_conn(fail)

    def run_release_many(self, environment: str, leases: Sequence[LeaseRef]) -> set[uuid.UUID]:
        if not leases:
            return set()
        params = _lease_params(leases)
        return self._with_conn(
            lambda conn: {row[0] for row in conn.execute(self._sql["run_release_many"], params)}
        )

    def run_mark_started(self, leases: Sequence[LeaseRef]) -> int:
        if not leases:
            return 0
        params = _lease_params(leases)
        return self._with_conn(
            lambda conn: len(conn.execute(self._sql["run_mark_started"], params).fetchall())
        )

    def run_extend_leases(
        self, leases: Sequence[LeaseRef], lease: timedelta, *, beat: WorkerBeat | None = None
    ) -> dict[LeaseRef, RunStatus]:
        if not leases and beat is None:
            return {}
        params = {
            **_lease_params(leases),
            **_beat_params(beat),
            "lease_seconds": lease.total_seconds(),
        }

        def extend(conn: Conn) -> dict[LeaseRef, RunStatus]:
            rows = conn.execute(self._sql["run_extend_leases"], params).fetchall()
            return {LeaseRef(row[0], row[1], row[2]): RunStatus(row[3]) for row in rows}

        return self._with_conn(extend)

    def run_deliver_due(
        self, environment: str, limit: int, *, fence: MaintenanceFence | None = None
    ) -> int:
        params = {"environment": environment, "limit": limit}
        return self._fenced(
            fence, lambda conn: len(conn.execute(self._sql["run_deliver_due"], params).fetchall())
        )

    # -- maintenance -----------------------------------------------------------------------

    def _fenced(self, fence: MaintenanceFence | None, fn: Callable[[Conn], T]) -> T:
        """Run ``fn`` in a transaction that first checks the band's lease is still current."""

        def run(conn: Conn) -> T:
            if fence is None:
                return fn(conn)
            with conn.transaction():
                held = conn.execute(self._sql["maintenance_fence"], attrs.asdict(fence)).fetchone()
                if held is None:
                    raise StaleLease(
                        f"maintenance lease of band {fence.band!r} (fencing {fence.fencing}) is "
                        "no longer held by this replica; another replica owns the band now"
                    )
                return fn(conn)

        return self._with_conn(run)

    def database_now(self) -> datetime:
        def now(conn: Conn) -> datetime:
            row = conn.execute(self._sql["database_now"]).fetchone()
            assert row is not None
            value: datetime = row[0]
            return value

        return self._with_conn(now)

    def run_list_expired(self, environment: str, limit: int) -> list[ExpiredAttempt]:
        params = {"environment": environment, "limit": limit}

        def listed(conn: Conn) -> list[ExpiredAttempt]:
            rows = conn.execute(self._sql["run_list_expired"], params).fetchall()
            return [
                ExpiredAttempt(
                    run_id=row[0],
                    task_id=row[1],
                    attempt=row[2],
                    attempts_consumed=row[3],
                    max_attempts=row[4],
                    lease_token=row[5],
                    lease_expires_at=row[6],
                    cancel_requested=bool(row[7]),
                )
                for row in rows
            ]

        return self._with_conn(listed)

    def run_expire_many(
        self, expirations: Sequence[Expiration], *, fence: MaintenanceFence | None = None
    ) -> list[FailureApplied]:
        if not expirations:
            return []
        params = {
            "ids": [e.run_id for e in expirations],
            "attempts": [e.attempt for e in expirations],
            "lease_tokens": [e.lease_token for e in expirations],
            "errors": [e.error for e in expirations],
            "retry_delay_seconds": [
                None if e.retry_delay is None else e.retry_delay.total_seconds()
                for e in expirations
            ],
        }

        def expire(conn: Conn) -> list[FailureApplied]:
            rows = conn.execute(self._sql["run_expire_many"], params).fetchall()
            return [FailureApplied(run_id=row[0], status=RunStatus(row[1])) for row in rows]

        return self._fenced(fence, expire)

    def run_wake_due_queues(self, environment: str, window: timedelta, limit: int) -> list[str]:
        params = {
            "environment": environment,
            "window_seconds": window.total_seconds(),
            "limit": limit,
        }
        return self._with_conn(
            lambda conn: [row[1] for row in conn.execute(self._sql["run_wake_due_queues"], params)]
        )

    def run_prune(
        self,
        environment: str,
        retention: dict[RunStatus, timedelta],
        limit: int,
        *,
        fence: MaintenanceFence | None = None,
    ) -> PruneResult:
        params = {
            "environment": environment,
            "limit": limit,
            "completed_seconds": retention[RunStatus.COMPLETED].total_seconds(),
            "failed_seconds": retention[RunStatus.FAILED].total_seconds(),
            "cancelled_seconds": retention[RunStatus.CANCELLED].total_seconds(),
        }

        def prune(conn: Conn) -> PruneResult:
            # run_prune picks and locks; run_prune_ids, delete_runs' too, deletes what it
            # picked in the same transaction (the fence's when fenced), so the locks hold
            with self._transaction(conn):
                ids = [row[0] for row in conn.execute(self._sql["run_prune"], params)]
                deleted, tombstoned = self._prune_ids(conn, environment, ids, skip_locked=False)
            return PruneResult(deleted=deleted, tombstoned=tombstoned)

        return self._fenced(fence, prune)

    def maintenance_lease_acquire(
        self, environment: str, band: str, owner: uuid.UUID, lease: timedelta
    ) -> int | None:
        params = {
            "environment": environment,
            "band": band,
            "owner": owner,
            "lease_seconds": lease.total_seconds(),
        }

        def acquire(conn: Conn) -> int | None:
            row = conn.execute(self._sql["maintenance_lease_acquire"], params).fetchone()
            return None if row is None else int(row[0])

        return self._with_conn(acquire)

    def maintenance_lease_refresh(self, fence: MaintenanceFence, lease: timedelta) -> bool:
        params = {**attrs.asdict(fence), "lease_seconds": lease.total_seconds()}
        return self._with_conn(
            lambda conn: (
                conn.execute(self._sql["maintenance_lease_refresh"], params).fetchone() is not None
            )
        )

    def maintenance_lease_release(self, fence: MaintenanceFence) -> bool:
        params = attrs.asdict(fence)
        return self._with_conn(
            lambda conn: (
                conn.execute(self._sql["maintenance_lease_release"], params).fetchone() is not None
            )
        )

    def maintenance_lease_list(self, environment: str) -> list[MaintenanceLeaseRow]:
        params = {"environment": environment}
        return self._with_conn(
            lambda conn: [
                MaintenanceLeaseRow(*row)
                for row in conn.execute(self._sql["maintenance_lease_list"], params)
            ]
        )

    def status_counts(self, environment: str) -> dict[str, Any]:
        def counts(conn: Conn) -> dict[str, Any]:
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(self._sql["status_counts"], {"environment": environment})
                row = cur.fetchone()
                assert row is not None
                cur.execute(self._sql["queue_list"], {"environment": environment})
                queues = status_queues(cur.fetchall())
                cur.execute(self._sql["status_resolved_tokens"], {"environment": environment})
                resolved = tuple(ResolvedTokenStatus(**token) for token in cur.fetchall())
            return {**row, "queues": queues, "resolved_tokens": resolved}

        return self._with_conn(counts)

    def maintenance_missing(self, environment: str) -> bool:
        params = {"environment": environment}

        def missing(conn: Conn) -> bool:
            row = conn.execute(self._sql["maintenance_missing"], params).fetchone()
            return bool(row and row[0])

        return self._with_conn(missing)

    # -- steps, waits, cancellation ------------------------------------------------------

    def step_get(self, run_id: uuid.UUID, name: str) -> tuple[bool, Any]:
        params = {"run_id": run_id, "name": name}

        def get(conn: Conn) -> tuple[bool, Any]:
            row = conn.execute(self._sql["step_get"], params).fetchone()
            return (False, None) if row is None else (True, row[0])

        return self._with_conn(get)

    def step_store(self, lease: LeaseRef, name: str, output: str) -> StepStored:
        params = {**_one_lease(lease), "name": name, "output": output}

        def store(conn: Conn) -> StepStored:
            row = conn.execute(self._sql["step_store"], params).fetchone()
            assert row is not None
            fenced, stored = bool(row[0]), row[1]
            if fenced and stored is None:  # an earlier writer won: answer with its output
                found = conn.execute(
                    self._sql["step_get"], {"run_id": lease.run_id, "name": name}
                ).fetchone()
                stored = None if found is None else found[0]
            return StepStored(fenced=fenced, output=stored)

        return self._with_conn(store)

    def run_suspend(
        self,
        lease: LeaseRef,
        environment: str,
        *,
        token_id: uuid.UUID | None = None,
        run_id: uuid.UUID | None = None,
        wake_at: datetime | None = None,
    ) -> SuspendResult:
        if sum(x is not None for x in (token_id, run_id, wake_at)) != 1:
            raise ValueError("suspend on exactly one of token_id, run_id, wake_at")
        kind = "token" if token_id is not None else "run" if run_id is not None else "sleep"
        params = {
            **_one_lease(lease),
            "environment": environment,
            "kind": kind,
            "target_id": token_id if token_id is not None else run_id,
            "wake_at": wake_at,
        }

        def suspend(conn: Conn) -> SuspendResult:
            row = conn.execute(self._sql["run_suspend"], params).fetchone()
            assert row is not None
            return SuspendResult(target_open=bool(row[0]), suspended=bool(row[1]))

        return self._with_conn(suspend)

    def run_release(self, lease: LeaseRef, delay: timedelta) -> bool:
        params = {**_one_lease(lease), "delay_seconds": delay.total_seconds()}

        def release(conn: Conn) -> bool:
            row = conn.execute(self._sql["run_release"], params).fetchone()
            return row is not None and row[0] > 0

        return self._with_conn(release)

    def run_resume_waiters(
        self,
        environment: str,
        limit: int,
        *,
        token_ids: Sequence[uuid.UUID] | None = None,
        run_ids: Sequence[uuid.UUID] | None = None,
        fence: MaintenanceFence | None = None,
    ) -> int:
        narrowed = token_ids is not None or run_ids is not None
        params = {
            "environment": environment,
            "limit": limit,
            "token_ids": list(token_ids or []) if narrowed else None,
            "run_ids": list(run_ids or []) if narrowed else None,
        }
        return self._fenced(
            fence,
            lambda conn: len(conn.execute(self._sql["run_resume_waiters"], params).fetchall()),
        )

    def wait_token_create(
        self,
        environment: str,
        token_id: uuid.UUID,
        timeout: timedelta | None,
        idempotency_key: str | None,
    ) -> WaitToken:
        params = {
            "environment": environment,
            "id": token_id,
            "idempotency_key": idempotency_key,
            "timeout_seconds": None if timeout is None else timeout.total_seconds(),
        }

        def create(conn: Conn) -> WaitToken:
            conn.execute(self._sql["wait_token_insert"], params)
            token = self._token_row(conn, environment, token_id, idempotency_key)
            if token is None:
                raise RuntimeError(f"wait token {token_id} was neither created nor found")
            return token

        return self._with_conn(create)

    def _token_row(
        self, conn: Conn, environment: str, token_id: uuid.UUID, key: str | None = None
    ) -> WaitToken | None:
        params = {"environment": environment, "id": token_id, "idempotency_key": key}
        with conn.cursor(row_factory=dict_row) as cur:
            cur.execute(self._sql["wait_token_get"], params)
            row = cur.fetchone()
        if row is None:
            return None
        return WaitToken(**{**row, "status": WaitTokenStatus(row["status"])})

    def wait_token_get(self, environment: str, token_id: uuid.UUID) -> WaitToken | None:
        return self._with_conn(lambda conn: self._token_row(conn, environment, token_id))

    def wait_token_complete(self, environment: str, token_id: uuid.UUID, output: str) -> bool:
        params = {"environment": environment, "id": token_id, "output": output}
        return self._with_conn(
            lambda conn: (
                conn.execute(self._sql["wait_token_complete"], params).fetchone() is not None
            )
        )

    def wait_token_time_out_due(
        self, environment: str, limit: int, *, fence: MaintenanceFence | None = None
    ) -> int:
        params = {"environment": environment, "limit": limit}
        return self._fenced(
            fence,
            lambda conn: len(conn.execute(self._sql["wait_token_time_out_due"], params).fetchall()),
        )

    def run_cancel(self, environment: str, run_id: uuid.UUID) -> tuple[RunStatus, RunStatus] | None:
        # run_cancel is keyed by ids: cancel_runs passes it a batch (see _bulk.py)
        params = {"environment": environment, "ids": [run_id], "skip_locked": False}

        def cancel(conn: Conn) -> tuple[RunStatus, RunStatus] | None:
            row = conn.execute(self._sql["run_cancel"], params).fetchone()
            if row is None:
                return None
            _, before, after = row
            previous = RunStatus(before)
            return previous, RunStatus(after) if after is not None else previous

        return self._with_conn(cancel)


def _one_lease(lease: LeaseRef) -> dict[str, Any]:
    return {"id": lease.run_id, "attempt": lease.attempt, "lease_token": lease.lease_token}


def _array_literal(values: Iterable[uuid.UUID | int]) -> str:
    """A Postgres array literal of uuids or integers (their text needs no quoting): much
    cheaper to make than psycopg's element-by-element array dumping, on the hot paths."""
    return "{" + ",".join(map(str, values)) + "}"


def _beat_params(beat: WorkerBeat | None) -> dict[str, Any]:
    """The heartbeat's parameters of run_extend_leases (all None: no heartbeat)."""
    if beat is None:
        return dict.fromkeys(_BEAT_FIELDS)
    return {
        "worker_id": beat.worker_id,
        "environment": beat.environment,
        "host": beat.host,
        "pid": beat.pid,
        "runlane_version": beat.runlane_version,
        "queues": list(beat.queues),
        "concurrency": beat.concurrency,
        "heartbeat_seconds": beat.heartbeat_seconds,
        "worker_state": beat.state.value,
    }


_BEAT_FIELDS = (
    "worker_id",
    "environment",
    "host",
    "pid",
    "runlane_version",
    "queues",
    "concurrency",
    "heartbeat_seconds",
    "worker_state",
)


def _lease_params(leases: Sequence[LeaseRef]) -> dict[str, Any]:
    return {
        "ids": _array_literal(ref.run_id for ref in leases),
        "attempts": _array_literal(ref.attempt for ref in leases),
        "lease_tokens": _array_literal(ref.lease_token for ref in leases),
    }


# the columns of a claim's row: ClaimedRun's fields, in their order and under their names,
# as the SQL fragment claim_returning (sql/fragments.sql) gives them (a test compares the
# names); rows may carry more columns after them (the flow-control claim's rate wait)
CLAIM_FIELDS = tuple(f.name for f in attrs.fields(ClaimedRun) if f.init)
_CLAIM_WIDTH = len(CLAIM_FIELDS)


def _claimed(rows: Sequence[tuple[Any, ...]]) -> list[ClaimedRun]:
    return [ClaimedRun(*row[:_CLAIM_WIDTH]) for row in rows]


def _snapshot(row: dict[str, Any]) -> RunSnapshot:
    error = row["error"]
    return RunSnapshot(
        id=row["id"],
        environment=row["environment"],
        task_id=row["task_id"],
        queue=row["queue"],
        status=RunStatus(row["status"]),
        attempt=row["attempt"],
        attempts_spent=row["attempts_spent"],
        max_attempts=row["max_attempts"],
        priority=row["priority"],
        payload=row["payload"],
        output=row["output"],
        error=None
        if error is None
        else RunError(
            type=error["type"],
            message=error["message"],
            traceback=error.get("traceback"),
            retryable=error.get("retryable", True),
        ),
        idempotency_key=row["idempotency_key"],
        parent_run_id=row["parent_run_id"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        due_at=row["due_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        progress=row.get("progress"),
        executing=bool(row.get("executing", False)),
    )
