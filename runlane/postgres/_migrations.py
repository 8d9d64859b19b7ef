"""The migration runner: installs the storage schema under a schema-scoped advisory lock.

The ledger (``runlane_migrations``) records each applied migration's version, name,
checksum and compatibility marker (``additive`` or ``breaking``, see ``_compat.py``). A
ledger newer than this release is left alone when its newer migrations are all additive (a
rolled-back application's deploy step may run this runner again), refused otherwise.
"""

from __future__ import annotations

import hashlib
from typing import Any

import attrs
import psycopg
from psycopg import sql

from runlane.errors import ConfigurationError, IncompatibleSchema
from runlane.postgres._compat import LedgerRow, marker_of, newer_than_known, without_marker
from runlane.postgres._connections import (
    DEFAULT_CONNECT_TIMEOUT,
    check_conninfo,
    connect_seconds,
    storage_error,
)
from runlane.postgres._sql import load_migration_files, render, validate_schema_name

__all__ = [
    "LEDGER_TABLE",
    "MigrationResult",
    "apply_postgres_storage_migrations",
    "known_checksums",
    "latest_version",
]

LEDGER_TABLE = "runlane_migrations"
_LEDGER_COLUMNS = {"version", "name", "checksum", "applied_at"}
# added by this release's runner to a ledger made before it (nullable: older rows)
_COMPATIBILITY = "compatibility"
# First key of the two-key advisory lock; the second is hashtext(schema), so migrators of
# different schemas never wait on each other.
_LOCK_CLASS = 0x726C6D67
_CONNECT_TIMEOUT = connect_seconds(DEFAULT_CONNECT_TIMEOUT)  # unless the string sets one


@attrs.frozen
class MigrationResult:
    """What one migration call did: the versions it applied and where the schema now stands."""

    schema: str
    applied: tuple[int, ...]
    version: int


def _checksum(text: str) -> str:
    # the compatibility marker line is not part of it: marking a file changes no checksum
    body = without_marker(text.replace("\r\n", "\n"))
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def latest_version() -> int:
    return len(load_migration_files())


def known_checksums() -> dict[int, str]:
    """The checksum of each migration this release ships, by version."""
    return {version: _checksum(text) for version, _, text in load_migration_files()}


def _check_ledger_shape(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> bool:
    """True when a ledger exists (with or without its compatibility column, which is then
    added); raise when something else holds its name."""
    row = conn.execute(
        "select c.oid, c.relkind from pg_class as c "
        "join pg_namespace as n on n.oid = c.relnamespace "
        "where n.nspname = %s and c.relname = %s",
        (schema, LEDGER_TABLE),
    ).fetchone()
    if row is None:
        return False
    oid, relkind = row
    if relkind not in ("r", b"r"):
        raise IncompatibleSchema(
            f"schema {schema!r} has a relation {LEDGER_TABLE!r} that is not a table; runlane "
            "did not create it: migrate into a fresh schema instead"
        )
    columns = {
        str(name)
        for (name,) in conn.execute(
            "select attname from pg_attribute "
            "where attrelid = %s and attnum > 0 and not attisdropped",
            (oid,),
        )
    }
    if columns == _LEDGER_COLUMNS:
        conn.execute(
            sql.SQL("alter table {}.{} add column {} text").format(
                sql.Identifier(schema), sql.Identifier(LEDGER_TABLE), sql.Identifier(_COMPATIBILITY)
            )
        )
    elif columns != _LEDGER_COLUMNS | {_COMPATIBILITY}:
        raise IncompatibleSchema(
            f"schema {schema!r} has a table {LEDGER_TABLE!r} that runlane did not create "
            f"(columns {sorted(columns)}); migrate into a fresh schema instead"
        )
    return True


def _check_ledger_rows(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> list[int]:
    """The versions applied; raises when the ledger is not this release's or an additive
    extension of it."""
    known = {version: (name, _checksum(text)) for version, name, text in load_migration_files()}
    rows = [
        LedgerRow(int(str(version)), str(name), str(checksum), None if c is None else str(c))
        for version, name, checksum, c in conn.execute(
            sql.SQL(
                "select version, name, checksum, compatibility from {}.{} order by version"
            ).format(sql.Identifier(schema), sql.Identifier(LEDGER_TABLE))
        ).fetchall()
    ]
    # a newer release's migrations: only when additive (raises naming a breaking one)
    newer = {row.version for row in newer_than_known(rows, len(known), schema)}
    applied: list[int] = []
    for row in rows:
        version, name, checksum = row.version, row.name, row.checksum
        if version in newer:
            applied.append(version)
            continue
        if version not in known:
            raise IncompatibleSchema(
                f"schema {schema!r} records migration {version!r} ({name}), which this runlane "
                f"does not know (it knows 1..{len(known)}): the schema was made by a newer or "
                "another runlane; upgrade runlane or migrate into a fresh schema"
            )
        if known[version] != (name, checksum):
            raise IncompatibleSchema(
                f"schema {schema!r} records migration {version} as {name!r} with a different "
                "checksum than this runlane ships: it was made by another runlane release and "
                "cannot be upgraded in place; migrate into a fresh schema"
            )
        applied.append(version)
    if applied != list(range(1, len(applied) + 1)):
        raise IncompatibleSchema(
            f"schema {schema!r} records migrations {applied}, which is not a complete prefix; "
            "the ledger was edited by hand"
        )
    return applied


def apply_postgres_storage_migrations(
    *, connection_string: str, schema: str = "runlane"
) -> MigrationResult:
    """Install or upgrade runlane's tables in ``schema``; a no-op when already current.

    Concurrent callers serialise on an advisory lock scoped to the schema: one applies the
    migrations, the others wait and then find nothing to do. A ledger this release does not
    recognise raises :class:`~runlane.IncompatibleSchema` and changes nothing. A malformed
    connection string raises :class:`~runlane.ConfigurationError`; a database that cannot
    be reached :class:`~runlane.StorageUnavailable`; a connected role that may not create or
    change the schema (an application role) :class:`~runlane.ConfigurationError`.
    """
    params = check_conninfo(connection_string)
    validate_schema_name(schema)
    try:
        return _apply(connection_string, schema, "connect_timeout" in params)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise ConfigurationError(
            f"the connected role may not migrate schema {schema!r} "
            f"({exc.diag.message_primary}): run migrations as the schema's owner (the role "
            "that created it, or one allowed to create schemas in this database), not as an "
            "application role granted a job with `runlane grant`"
        ) from exc
    except psycopg.Error as exc:
        raise storage_error(exc, connection_string, f"migrate schema {schema!r}") from exc


def _apply(connection_string: str, schema: str, timeout_given: bool) -> MigrationResult:
    files = load_migration_files()
    # libpq waits forever for an unreachable host unless told otherwise
    timeout: dict[str, Any] = {} if timeout_given else {"connect_timeout": _CONNECT_TIMEOUT}
    with (
        psycopg.connect(connection_string, autocommit=True, **timeout) as conn,
        conn.transaction(),
    ):
        conn.execute("select pg_advisory_xact_lock(%s, hashtext(%s))", (_LOCK_CLASS, schema))
        conn.execute(sql.SQL("create schema if not exists {}").format(sql.Identifier(schema)))
        if not _check_ledger_shape(conn, schema):
            conn.execute(
                sql.SQL(
                    "create table {}.{} (version integer primary key, name text not null, "
                    "checksum text not null, applied_at timestamptz not null default now(), "
                    "compatibility text)"
                ).format(sql.Identifier(schema), sql.Identifier(LEDGER_TABLE))
            )
        done = set(_check_ledger_rows(conn, schema))
        ledger = sql.Identifier(schema), sql.Identifier(LEDGER_TABLE)
        applied: list[int] = []
        for version, name, text in files:
            if version in done:
                # rows recorded before the compatibility column get the shipped marker
                conn.execute(
                    sql.SQL(
                        "update {}.{} set compatibility = %s "
                        "where version = %s and compatibility is null"
                    ).format(*ledger),
                    (marker_of(text), version),
                )
                continue
            try:
                conn.execute(render(text, schema).encode("utf-8"))
            except psycopg.errors.DuplicateTable as exc:
                raise IncompatibleSchema(
                    f"schema {schema!r} already holds a table that migration {version} "
                    f"({name}) creates, but no ledger records it; migrate into a fresh schema "
                    f"({exc.diag.message_primary})"
                ) from exc
            conn.execute(
                sql.SQL(
                    "insert into {}.{} (version, name, checksum, compatibility) "
                    "values (%s, %s, %s, %s)"
                ).format(*ledger),
                (version, name, _checksum(text), marker_of(text)),
            )
            applied.append(version)
    return MigrationResult(schema=schema, applied=tuple(applied), version=max([len(files), *done]))
