"""The migration runner: installs the storage schema under a schema-scoped advisory lock."""

from __future__ import annotations

import hashlib
from typing import Any

import attrs
import psycopg
from psycopg import sql

from runlane.errors import ConfigurationError, IncompatibleSchema
from runlane.postgres._connections import check_conninfo, storage_error
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
# First key of the two-key advisory lock; the second is hashtext(schema), so migrators of
# different schemas never wait on each other.
_LOCK_CLASS = 0x726C6D67
_CONNECT_TIMEOUT = 10  # seconds, unless the connection string sets connect_timeout


@attrs.frozen
class MigrationResult:
    """What one migration call did: the versions it applied and where the schema now stands."""

    schema: str
    applied: tuple[int, ...]
    version: int


def _checksum(text: str) -> str:
    return hashlib.sha256(text.replace("\r\n", "\n").encode("utf-8")).hexdigest()


def latest_version() -> int:
    return len(load_migration_files())


def known_checksums() -> dict[int, str]:
    """The checksum of each migration this release ships, by version."""
    return {version: _checksum(text) for version, _, text in load_migration_files()}


def _check_ledger_shape(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> bool:
    """True when a ledger exists; raise when something else holds its name."""
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
    if columns != _LEDGER_COLUMNS:
        raise IncompatibleSchema(
            f"schema {schema!r} has a table {LEDGER_TABLE!r} that runlane did not create "
            f"(columns {sorted(columns)}); migrate into a fresh schema instead"
        )
    return True


def _check_ledger_rows(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> list[int]:
    known = {version: (name, _checksum(text)) for version, name, text in load_migration_files()}
    rows = conn.execute(
        sql.SQL("select version, name, checksum from {}.{} order by version").format(
            sql.Identifier(schema), sql.Identifier(LEDGER_TABLE)
        )
    ).fetchall()
    applied: list[int] = []
    for version, name, checksum in rows:
        if not isinstance(version, int) or version not in known:
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
                    "checksum text not null, applied_at timestamptz not null default now())"
                ).format(sql.Identifier(schema), sql.Identifier(LEDGER_TABLE))
            )
        done = set(_check_ledger_rows(conn, schema))
        applied: list[int] = []
        for version, name, text in files:
            if version in done:
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
                sql.SQL("insert into {}.{} (version, name, checksum) values (%s, %s, %s)").format(
                    sql.Identifier(schema), sql.Identifier(LEDGER_TABLE)
                ),
                (version, name, _checksum(text)),
            )
            applied.append(version)
    return MigrationResult(schema=schema, applied=tuple(applied), version=len(files))
