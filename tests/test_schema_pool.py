"""The suite's schema pool (tests/_schemas.py): a test's schema is handed to a later test
only when nothing but its rows changed, including when its fingerprint is skipped because
its catalogue's row versions are those noted when it was last found pristine."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from tests._schemas import LEDGER, SchemaPool
from tests.helpers import Conn

ROW = (
    "insert into {s}.wait_tokens (id, environment, status) "
    "values (gen_random_uuid(), 'e', 'pending')"
)


@pytest.fixture
def pool(database_url: str) -> Iterator[SchemaPool]:
    made = SchemaPool(database_url)
    try:
        yield made
    finally:
        made.close()


def _run(db: Conn, statement: str, schema: str) -> None:
    db.execute(sql.SQL(statement).format(s=sql.Identifier(schema)))


def _noted(pool: SchemaPool, db: Conn) -> str:
    """A schema the pool has found pristine once (its row versions noted), taken again."""
    name = pool.take()
    _run(db, ROW, name)
    assert pool.give_back(name)
    assert pool.take() == name
    return name


def _count(db: Conn, schema: str, table: str) -> int:
    row = db.execute(
        sql.SQL("select count(*) from {}").format(sql.Identifier(schema, table))
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_schema_whose_rows_alone_changed_is_emptied_and_handed_on_fingerprinted_once(
    pool: SchemaPool, db: Conn
) -> None:
    name = pool.take()
    for _ in range(3):
        _run(db, ROW, name)
        assert pool.give_back(name)
        assert _count(db, name, "wait_tokens") == 0
        assert pool.take() == name
    assert (pool.migrated, pool.handed_on) == (1, 3)
    assert pool.fingerprinted == 1  # the later hand-backs matched its row versions


FUNCTION = (
    "select 'alter function ' || oid::regprocedure::text || ' set work_mem = 1024' "
    "from pg_proc where pronamespace = %s::regnamespace limit 1"
)


@pytest.mark.parametrize(
    "change",
    [
        "create index on {s}.wait_tokens (environment)",
        "alter table {s}.wait_tokens add column extra int",
        "alter table {s}.wait_tokens alter column environment set default 'x'",
        "grant select on {s}.wait_tokens to public",
        "grant usage on schema {s} to public",
        "alter default privileges in schema {s} grant select on tables to public",
        "create function {s}.extra() returns int language sql as 'select 1'",
        "create table {s}.extra (id int)",
        "update {s}.runlane_migrations set checksum = 'changed' "
        "where version = (select max(version) from {s}.runlane_migrations)",
        "function",  # a setting of one of the schema's functions (an in-place change)
    ],
)
def test_a_schema_changed_beyond_its_rows_is_not_handed_on(
    pool: SchemaPool, db: Conn, database_url: str, change: str
) -> None:
    name = _noted(pool, db)
    if change == "function":
        row = db.execute(FUNCTION, (name,)).fetchone()
        assert row is not None
        db.execute(row[0])
    else:
        _run(db, change, name)
    assert not pool.give_back(name)
    assert pool.fingerprinted == 2  # its row versions (or its ledger) differed from those noted
    assert pool.take() != name  # a fresh migration instead
    assert pool.migrated == 2


def test_a_change_undone_before_the_hand_back_is_found_pristine_by_the_fingerprint(
    pool: SchemaPool, db: Conn
) -> None:
    name = _noted(pool, db)
    _run(db, "alter table {s}.wait_tokens alter column environment set default 'x'", name)
    _run(db, "alter table {s}.wait_tokens alter column environment drop default", name)
    assert pool.give_back(name)  # row versions differ; the fingerprint is a fresh migration's
    assert pool.fingerprinted == 2
    assert pool.take() == name
    assert pool.give_back(name)
    assert pool.fingerprinted == 2  # its new row versions were noted


def test_a_schema_that_reached_a_broker_is_not_handed_on(pool: SchemaPool, db: Conn) -> None:
    name = _noted(pool, db)
    _run(db, "insert into {s}.outbox_environments values ('e', 20)", name)
    assert not pool.give_back(name)


def test_a_lost_connection_costs_one_hand_back_not_the_pool(
    pool: SchemaPool, db: Conn, database_url: str
) -> None:
    name = _noted(pool, db)
    assert pool._conn is not None
    pid = pool._conn.info.backend_pid
    db.execute("select pg_terminate_backend(%s)", (pid,))
    assert not pool.give_back(name)  # the hand-back's statement met the dead connection
    fresh = pool.take()
    assert fresh != name
    assert pool.give_back(fresh)  # on a new connection
    assert pool._conn is not None
    assert pool._conn.info.backend_pid != pid
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("select count(*) from {}").format(sql.Identifier(fresh, LEDGER))
        ).fetchone()
        assert row is not None
        assert row[0] > 0  # the ledger is kept
