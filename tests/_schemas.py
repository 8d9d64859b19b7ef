"""Migrated schemas handed from one test to the next within a test process.

Migrating a schema costs the embedded server about 130 ms of CPU (the DDL of every migration)
and the suite migrates one per test: on 2 cores that alone was minutes of the run. A test's
schema is therefore emptied after it and given to a later test of the same process instead,
but only when nothing but its rows changed: its catalogue (tables, columns, constraints,
indexes, functions and their text, triggers, privileges, the migration ledger) must match the
fingerprint of a freshly migrated schema, or it is left alone and the next test migrates a new
one. A schema whose name reached the broker (the RabbitMQ lane names its queues after the
schema) is never handed on, so a later test cannot meet an earlier one's queues or messages.

Emptying is a ``DELETE`` from every table but the ledger (the schema has no sequences),
under a short lock timeout (a connection some test left in a transaction on it makes the
schema unusable rather than the test slow). A schema is only ever in one test's hands.

The fingerprint deparses every index, constraint and trigger (about 14 ms of server CPU, as
much as the rest of a hand-back), so it is computed once per schema: when a schema is first
found pristine, the pool also notes its catalogue's row versions (each catalogue row's key
and ``xmin``: any DDL on the schema inserts, deletes or rewrites one of them, while
``ANALYZE`` and vacuum's in-place updates touch no column the fingerprint reads). A later
hand-back whose row versions are those noted skips the fingerprint; any other computes it
again. The pool keeps one connection for its hand-backs rather than one per test.
"""

from __future__ import annotations

import uuid
from typing import Any, LiteralString

import psycopg
from psycopg import sql

from runlane.postgres import apply_postgres_storage_migrations

__all__ = ["SchemaPool", "new_schema_name"]

LEDGER: LiteralString = "runlane_migrations"

# Everything about a schema but its rows, with its name replaced by '@' (function bodies,
# index and trigger definitions carry it), as one md5.
_FINGERPRINT: LiteralString = """
with n as (select oid from pg_namespace where nspname = %(s)s)
select md5(coalesce(string_agg(y, E'\n' order by y), ''))
from (select replace(x, %(s)s, '@') as y from (
    select 'nsp ' || coalesce(nspacl::text, '') || nspowner::regrole::text as x
    from pg_namespace where oid = (select oid from n)
    union all
    select 'rel ' || relname || ' ' || relkind::text || relpersistence::text || relrowsecurity::text
        || coalesce(relacl::text, '') || coalesce(reloptions::text, '')
        || relowner::regrole::text
    from pg_class where relnamespace = (select oid from n)
    union all
    select 'att ' || c.relname || '.' || a.attname || ' '
        || format_type(a.atttypid, a.atttypmod) || a.attnotnull::text
        || coalesce(a.attacl::text, '') || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
    from pg_attribute as a
    join pg_class as c on c.oid = a.attrelid
    left join pg_attrdef as d on d.adrelid = a.attrelid and d.adnum = a.attnum
    where c.relnamespace = (select oid from n) and a.attnum > 0 and not a.attisdropped
    union all
    select 'con ' || conname || ' ' || pg_get_constraintdef(oid) || convalidated::text
    from pg_constraint where connamespace = (select oid from n)
    union all
    select 'idx ' || pg_get_indexdef(i.indexrelid) || i.indisvalid::text
    from pg_index as i join pg_class as c on c.oid = i.indexrelid
    where c.relnamespace = (select oid from n)
    union all
    select 'fn ' || proname || '(' || pg_get_function_identity_arguments(oid) || ') '
        || md5(replace(prosrc, %(s)s, '@')) || coalesce(proacl::text, '') || provolatile::text
        || prosecdef::text || coalesce(proconfig::text, '') || proowner::regrole::text
    from pg_proc where pronamespace = (select oid from n)
    union all
    select 'trg ' || pg_get_triggerdef(t.oid) || t.tgenabled::text
    from pg_trigger as t join pg_class as c on c.oid = t.tgrelid
    where c.relnamespace = (select oid from n) and not t.tgisinternal
    union all
    select 'pol ' || p.polname
    from pg_policy as p join pg_class as c on c.oid = p.polrelid
    where c.relnamespace = (select oid from n)
    union all
    select 'typ ' || typname || typtype::text
    from pg_type where typnamespace = (select oid from n) and typtype not in ('b', 'c')
    union all
    select 'acl ' || defaclacl::text
    from pg_default_acl where defaclnamespace = (select oid from n)
) as parts) as normalised
"""

# The key and row version (xmin) of every catalogue row the fingerprint reads, as one md5:
# unchanged as long as no DDL touched the schema
_ROW_VERSIONS: LiteralString = """
with n as (select oid from pg_namespace where nspname = %(s)s),
     c as (select oid from pg_class where relnamespace = (select oid from n))
select md5(coalesce(string_agg(x, ',' order by x), ''))
from (
    select 'n' || oid || ':' || xmin from pg_namespace where oid = (select oid from n)
    union all
    select 'c' || oid || ':' || xmin from pg_class where oid in (select oid from c)
    union all
    select 'a' || attrelid || '.' || attnum || ':' || xmin
    from pg_attribute where attrelid in (select oid from c)
    union all
    select 'd' || oid || ':' || xmin from pg_attrdef where adrelid in (select oid from c)
    union all
    select 'k' || oid || ':' || xmin from pg_constraint where connamespace = (select oid from n)
    union all
    select 'i' || indexrelid || ':' || xmin from pg_index where indrelid in (select oid from c)
    union all
    select 'p' || oid || ':' || xmin from pg_proc where pronamespace = (select oid from n)
    union all
    select 't' || oid || ':' || xmin from pg_trigger where tgrelid in (select oid from c)
    union all
    select 'o' || oid || ':' || xmin from pg_policy where polrelid in (select oid from c)
    union all
    select 'y' || oid || ':' || xmin from pg_type where typnamespace = (select oid from n)
    union all
    select 'l' || oid || ':' || xmin from pg_default_acl
    where defaclnamespace = (select oid from n)
) as rows(x)
"""

_LEDGER_ROWS: LiteralString = (
    "select string_agg(concat_ws('|', version, name, checksum, compatibility), ';' "
    "order by version) from {}.{}"
)

# The schema's tables but the ledger, those another table references last
_TABLES: LiteralString = """
select c.relname from pg_class as c
where c.relnamespace = (select oid from pg_namespace where nspname = %s)
  and c.relkind in ('r', 'p') and c.relname <> %s
order by exists (select from pg_constraint as f where f.contype = 'f' and f.confrelid = c.oid),
         c.relname
"""


def new_schema_name() -> str:
    """A schema name no test has used: ``t_`` and 16 hex digits."""
    return f"t_{uuid.uuid4().hex[:16]}"


class SchemaPool:
    """Migrated schemas of one server for one test process (see the module's docstring).

    ``take()`` returns an empty migrated schema; ``give_back(name)`` offers one back after
    its test, which keeps it for a later ``take()`` only when its catalogue is a fresh
    migration's. ``handed_on`` and ``migrated`` count, for the suite's figures."""

    def __init__(self, database_url: str) -> None:
        self._url = database_url
        self._free: list[str] = []
        self._pristine: tuple[str, str] | None = None  # catalogue, ledger rows
        # schema -> its catalogue's row versions when it was last found pristine
        self._versions: dict[str, str] = {}
        self._conn: psycopg.Connection[Any] | None = None
        self.migrated = 0
        self.handed_on = 0
        self.fingerprinted = 0

    def take(self) -> str:
        if self._free:
            self.handed_on += 1
            return self._free.pop()
        name = new_schema_name()
        apply_postgres_storage_migrations(connection_string=self._url, schema=name)
        self.migrated += 1
        if self._pristine is None:
            with psycopg.connect(self._url, autocommit=True) as conn:
                self._pristine = _state(conn, name)
        return name

    def give_back(self, name: str) -> bool:
        """Empty ``name`` and keep it for a later test if nothing but its rows changed;
        returns whether it was kept."""
        if self._pristine is None:
            return False
        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(self._url, autocommit=True)
            conn = self._conn
            with conn.transaction():
                conn.execute("set local lock_timeout = '2s'")
                if not self._pristine_now(conn, name) or _reached_a_broker(conn, name):
                    return False
                tables = [r[0] for r in conn.execute(_TABLES, (name, LEDGER)).fetchall()]
                # DELETE, not TRUNCATE: a test leaves a few rows, and TRUNCATE's new files
                # for every table and index cost half of what a migration does
                conn.execute(
                    sql.SQL("; ").join(
                        sql.SQL("delete from {}").format(sql.Identifier(name, t)) for t in tables
                    )
                )
        except psycopg.Error:
            self._versions.pop(name, None)
            if self._conn is not None:
                self._conn.close()  # a new one next time, whatever state this one is in
                self._conn = None
            return False
        self._free.append(name)
        return True

    def _pristine_now(self, conn: psycopg.Connection[Any], name: str) -> bool:
        """Whether ``name``'s catalogue and ledger are a fresh migration's: its row versions
        as noted when it was last found so (and its ledger rows as then), else the full
        fingerprint."""
        versions = _row_versions(conn, name)
        if self._versions.get(name) == versions and _ledger(conn, name) == self._pristine_ledger:
            return True
        self.fingerprinted += 1
        if _state(conn, name) != self._pristine:
            self._versions.pop(name, None)
            return False
        self._versions[name] = versions
        return True

    @property
    def _pristine_ledger(self) -> str:
        assert self._pristine is not None
        return self._pristine[1]

    def close(self) -> None:
        """Close the connection kept for hand-backs."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _reached_a_broker(conn: psycopg.Connection[Any], name: str) -> bool:
    """Whether a transport lane used the schema: its outbox holds an item or an
    environment (their broker queues are named after the schema)."""
    row = conn.execute(
        sql.SQL(
            "select exists (select from {}.outbox) or exists (select from {}.outbox_environments)"
        ).format(sql.Identifier(name), sql.Identifier(name))
    ).fetchone()
    return row is None or bool(row[0])


def _state(conn: psycopg.Connection[Any], name: str) -> tuple[str, str]:
    """The schema's catalogue fingerprint and its ledger's rows."""
    row = conn.execute(_FINGERPRINT, {"s": name}).fetchone()
    assert row is not None
    return str(row[0]), _ledger(conn, name)


def _ledger(conn: psycopg.Connection[Any], name: str) -> str:
    """The schema's ledger rows, as one string ("" without a ledger)."""
    try:
        with conn.transaction():
            ledger = conn.execute(
                sql.SQL(_LEDGER_ROWS).format(sql.Identifier(name), sql.Identifier(LEDGER))
            ).fetchone()
    except psycopg.errors.UndefinedTable:
        return ""
    return "" if ledger is None or ledger[0] is None else str(ledger[0])


def _row_versions(conn: psycopg.Connection[Any], name: str) -> str:
    """The key and xmin of every catalogue row of the schema the fingerprint reads, as one
    md5."""
    row = conn.execute(_ROW_VERSIONS, {"s": name}).fetchone()
    assert row is not None
    return str(row[0])
