"""Named statements sent through libpq directly, past psycopg's cursor layer.

For group commit's statements (``postgres/_group.py``): the shared insert, which a leader
sends while its group waits, and a call's insert written alone. psycopg's cursor path (the
cursor, the query's conversion, the parameters' adaptation, its prepared-statement cache,
the result's description) cost about 80 us of Python a statement under the GIL on the
benchmark machine, on the path between two statements (benchmarks/README.md). Here the
statement is prepared once a connection under a name of its own, its parameters are text
already (their types inferred by the server from the statement, as for an untyped
literal; encoded in the connection's client encoding, as psycopg encodes them), and it is
sent and waited for with psycopg's own non-blocking wait (the GIL is released while it
waits; Ctrl-C cancels it as psycopg's does). A failed statement raises
the psycopg error a cursor would have (``UniqueViolation``, ...), so callers handle both
paths alike; a connection that broke is left broken for its pool to discard.

``generators.execute``, ``Connection.wait`` and ``errors.error_from_result`` are psycopg's
own machinery rather than its documented API (``pq`` is documented). They are used only
with the psycopg releases this path was tested against (``TESTED_PSYCOPG``, checked when
this module loads; no upper bound is forced on users): with any other release, or with
``RUNLANE_PSYCOPG_LIBPQ=0`` in the environment, the same statements go through psycopg's
public cursor API and come back as the same text (``RAW_PATH`` says which is in use); so
do they on a connection whose ``prepare_threshold`` is None (through a transaction-mode
pooler: no statement may be prepared by name, ``postgres/_pooler.py``). The
trigger tests run both ways (tests/test_pq.py, test_group_commit.py, test_trigger.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg import errors, generators, pq
from psycopg.adapt import Buffer, Loader

from runlane.postgres._connections import Conn
from runlane.postgres._now import set_now

__all__ = ["RAW_PATH", "TESTED_PSYCOPG", "RawStatement"]

#: The psycopg releases (major, minor) whose internals the libpq path was tested against.
TESTED_PSYCOPG = ((3, 3),)


def _raw_path_usable() -> bool:
    """Whether this psycopg is one the libpq path was tested with, and has what it uses."""
    if os.environ.get("RUNLANE_PSYCOPG_LIBPQ", "1") == "0":
        return False
    release = tuple(int(part) for part in re.findall(r"\d+", psycopg.__version__)[:2])
    return (
        release in TESTED_PSYCOPG
        and callable(getattr(generators, "execute", None))
        and callable(getattr(psycopg.Connection, "wait", None))
        and callable(getattr(errors, "error_from_result", None))
    )


#: True: statements go through libpq directly; False: through psycopg's public cursor API.
RAW_PATH = _raw_path_usable()

# the result types the cursor path reads back as the server's text, as the libpq path does
_TEXT_TYPES = (
    "bool", "int2", "int4", "int8", "oid", "float4", "float8", "numeric", "text", "varchar",
    "bpchar", "name", "uuid", "json", "jsonb", "date", "time", "timetz", "timestamp",
    "timestamptz", "interval",
)  # fmt: skip


class _AsText(Loader):
    """A value as the text the server sent."""

    def load(self, data: Buffer) -> str:
        encoding = self.connection.info.encoding if self.connection is not None else "utf-8"
        return bytes(data).decode(encoding)


_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_FATAL = pq.ExecStatus.FATAL_ERROR
_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)


class RawStatement:
    """One named statement of ``sql/`` (psycopg's ``%(name)s`` placeholders), executed
    through libpq on a connection of the storage's (autocommit, idle, not in a pipeline).

    Its parameters are sent as text, in the order they first appear in the statement (its
    ``now``, if it reads the clock, is ``clock()``: see _now.py; None without a clock);
    ``rows()`` returns the statement's rows as text (None for NULL). The prepared name
    carries a digest of the rendered text, so storages of different schemas sharing a
    connection never meet each other's statement."""

    def __init__(self, name: str, text: str, clock: Callable[[], datetime] | None = None) -> None:
        params: list[str] = []

        def positional(match: re.Match[str]) -> str:
            if match[1] not in params:
                params.append(match[1])
            return f"${params.index(match[1]) + 1}"

        converted = _PLACEHOLDER.sub(positional, text)
        if "%" in converted:
            # psycopg would read "%%" or a positional "%s"; the statements sent this way use
            # named placeholders only
            raise ValueError(f"statement {name!r} has a placeholder other than %(name)s")
        digest = hashlib.md5(converted.encode(), usedforsecurity=False).hexdigest()[:12]
        self.name = name
        self.params = tuple(params)
        self._clock = clock
        self._source = text
        self._prepared_name = f"runlane_{name}_{digest}".encode()
        self._text = converted
        # the connections this statement is prepared on (a connection's prepared statements
        # live and die with it; DISCARD ALL or DEALLOCATE drop them: see rows())
        self._prepared: weakref.WeakSet[Conn] = weakref.WeakSet()

    def rows(self, conn: Conn, values: Mapping[str, object]) -> list[tuple[str | None, ...]]:
        """Execute with ``values`` (by parameter name: None for NULL, or a str, int, float,
        UUID or datetime, sent as its text); the rows it returned."""
        if self._clock is not None:  # one moment for the statement and its triggers
            moment = self._clock()
            set_now(conn, moment)
            values = {**values, "now": moment} if "now" in self.params else values
        elif "now" in self.params:
            values = {**values, "now": None}
        args = self._encoded(conn, values)
        if not RAW_PATH or conn.prepare_threshold is None:
            # a connection that prepares nothing by name (through a transaction pooler,
            # postgres/_pooler.py, whose next transaction may run on another server session)
            return self._cursor_rows(conn, values)
        encoding = conn.info.encoding
        with conn.lock:
            if conn not in self._prepared:
                self._prepare(conn)
            result = self._execute(conn, args)
            if result.status == _FATAL and _sqlstate(result) == "26000":
                # prepared here before, gone since (DISCARD ALL, DEALLOCATE): once more
                self._prepared.discard(conn)
                self._prepare(conn)
                result = self._execute(conn, args)
        _check(result, conn)
        return [
            tuple(
                None if (cell := result.get_value(row, col)) is None else cell.decode(encoding)
                for col in range(result.nfields)
            )
            for row in range(result.ntuples)
        ]

    def _encoded(self, conn: Conn, values: Mapping[str, object]) -> list[bytes | None]:
        """The parameters' text in the connection's client encoding (which libpq tells the
        server the bytes are in); a value it cannot hold, or one holding NUL, is refused
        with psycopg's DataError on both paths."""
        encoding = conn.info.encoding
        try:
            args = [
                None if (text := _as_text(values[p])) is None else text.encode(encoding)
                for p in self.params
            ]
        except UnicodeEncodeError as exc:
            raise psycopg.DataError(
                f"a value cannot be written in the connection's client encoding "
                f"{encoding!r}: {exc.reason} ({exc.object[exc.start : exc.end]!r})"
            ) from exc
        if any(arg is not None and b"\x00" in arg for arg in args):
            # libpq reads a text parameter up to its first NUL: refuse it, as psycopg does,
            # rather than send a value cut short (runlane's validation refuses it earlier)
            raise psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
        return args

    def _cursor_rows(
        self, conn: Conn, values: Mapping[str, object]
    ) -> list[tuple[str | None, ...]]:
        """The same statement and rows through psycopg's public API (a psycopg release the
        libpq path was not tested with)."""
        params: dict[str, Any] = {p: values[p] for p in self.params}
        with conn.cursor() as cur:
            for name in _TEXT_TYPES:
                cur.adapters.register_loader(name, _AsText)
            cur.execute(self._source, params)
            if cur.description is None:
                return []
            return [tuple(row) for row in cur.fetchall()]

    def _prepare(self, conn: Conn) -> None:
        pgconn = conn.pgconn
        pgconn.send_prepare(self._prepared_name, self._text.encode(conn.info.encoding))
        result = _last(conn.wait(generators.execute(pgconn)))
        # 42P05: prepared already under this name (another storage of this schema shares
        # the connection): the same text, by the digest in the name
        if result.status != _FATAL or _sqlstate(result) != "42P05":
            _check(result, conn)
        self._prepared.add(conn)

    def _execute(self, conn: Conn, args: Sequence[bytes | None]) -> pq.abc.PGresult:
        pgconn = conn.pgconn
        pgconn.send_query_prepared(self._prepared_name, args)
        return _last(conn.wait(generators.execute(pgconn)))


def _as_text(value: object) -> str | None:
    """A parameter's text, as Postgres reads it for the type it infers."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int | uuid.UUID):
        return str(value)
    raise TypeError(
        "a statement parameter must be text, a number, a UUID or a datetime, "
        f"got {type(value).__name__}"
    )


def _last(results: list[pq.abc.PGresult]) -> pq.abc.PGresult:
    """The result of a statement: its first error if any, else its last result."""
    for result in results:
        if result.status == _FATAL:
            return result
    if not results:
        raise psycopg.OperationalError("the server sent no result for the statement")
    return results[-1]


def _sqlstate(result: pq.abc.PGresult) -> str | None:
    value = result.error_field(pq.DiagnosticField.SQLSTATE)
    return None if value is None else value.decode("ascii", "replace")


def _check(result: pq.abc.PGresult, conn: Conn) -> None:
    """Raise what a cursor would have raised for ``result``."""
    if result.status == _FATAL:
        raise errors.error_from_result(result, encoding=conn.info.encoding)
    if result.status not in _OK:
        raise psycopg.InternalError(f"unexpected result status {pq.ExecStatus(result.status).name}")
