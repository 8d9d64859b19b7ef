"""Statements sent through libpq directly (postgres/_pq.py): group commit's shared insert,
and the same statements through psycopg's cursor API where the libpq path is not used.

Against a real server: the placeholders, the text values, one preparation a connection
(and again after the server dropped it), the error a cursor would have raised with the
connection left usable, and a broken connection left broken for its pool. The statements
themselves are tested through group commit (test_group_commit.py).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg import pq

from runlane.postgres._pq import RawStatement

# every test runs with the statements sent through libpq and through the cursor API
pytestmark = pytest.mark.usefixtures("statement_path")


def prepared_names(conn: psycopg.Connection[Any]) -> list[str]:
    rows = conn.execute("select name from pg_prepared_statements order by name").fetchall()
    return [row[0] for row in rows if row[0].startswith("runlane_")]


def test_named_placeholders_become_positional_in_order_of_first_use() -> None:
    statement = RawStatement("pair", "select %(b)s::int, %(a)s::int, %(b)s::int + 1")
    assert statement.params == ("b", "a")
    for text in ("select %s", "select '100%%'", "select %(a)s, %s"):
        with pytest.raises(ValueError, match="placeholder other than"):
            RawStatement("bad", text)


def test_rows_come_back_as_text_with_null_as_none(db: psycopg.Connection[Any]) -> None:
    statement = RawStatement(
        "texts", "select %(n)s::int + 1, null::text, %(word)s::text union all select 7, 'x', 'y'"
    )
    assert statement.rows(db, {"n": "41", "word": "zwölf"}) == [
        ("42", None, "zwölf"),
        ("7", "x", "y"),
    ]
    assert RawStatement("none", "select 1 where false").rows(db, {}) == []


def test_python_values_are_sent_as_the_text_postgres_reads(db: psycopg.Connection[Any]) -> None:
    run_id = uuid.UUID("0192f0c4-1c2a-7b3c-8d4e-5f6a7b8c9d0e")
    at = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
    statement = RawStatement(
        "typed",
        "select %(i)s::int + 1, %(f)s::float8 * 2, %(u)s::uuid, "
        "%(t)s::timestamptz = '2031-05-06 07:08:09.123456+00', %(n)s::text is null",
    )
    values = {"i": 41, "f": 1e-06, "u": run_id, "t": at, "n": None}
    assert statement.rows(db, values) == [("42", "2e-06", str(run_id), "t", "t")]
    with pytest.raises(TypeError, match="got dict"):
        statement.rows(db, {**values, "i": {"no": 1}})


def test_a_statement_is_prepared_once_a_connection_and_again_after_the_server_dropped_it(
    db: psycopg.Connection[Any], database_url: str, statement_path: str
) -> None:
    if statement_path == "cursor":
        pytest.skip("the libpq path's own preparation (the cursor path leaves it to psycopg)")
    statement = RawStatement("twice", "select %(x)s::int * 2")
    for x in range(3):
        assert statement.rows(db, {"x": str(x)}) == [(str(2 * x),)]
    (name,) = prepared_names(db)
    assert name.startswith("runlane_twice_")
    db.execute("deallocate all")  # as DISCARD ALL does
    assert statement.rows(db, {"x": "5"}) == [("10",)]
    assert prepared_names(db) == [name]
    # another connection prepares it for itself; a second statement object of the same
    # text (another storage of this schema sharing the connection) meets it prepared
    with psycopg.connect(database_url, autocommit=True) as other:
        assert statement.rows(other, {"x": "1"}) == [("2",)]
        assert prepared_names(other) == [name]
    assert RawStatement("twice", "select %(x)s::int * 2").rows(db, {"x": "4"}) == [("8",)]
    # the same name with another text (another schema's statement) is another statement
    RawStatement("twice", "select %(x)s::int * 3").rows(db, {"x": "1"})
    assert len(prepared_names(db)) == 2


def test_a_failed_statement_raises_the_cursor_error_and_leaves_the_connection_usable(
    db: psycopg.Connection[Any],
) -> None:
    db.execute("create temporary table keys (k int primary key)")
    insert = RawStatement("insert_key", "insert into keys values (%(k)s::int)")
    insert.rows(db, {"k": "1"})
    with pytest.raises(psycopg.errors.UniqueViolation) as caught:
        insert.rows(db, {"k": "1"})
    assert caught.value.sqlstate == "23505"
    assert caught.value.diag.constraint_name == "keys_pkey"
    with pytest.raises(psycopg.errors.InvalidTextRepresentation):
        insert.rows(db, {"k": "one"})
    assert db.info.transaction_status == pq.TransactionStatus.IDLE
    insert.rows(db, {"k": "2"})
    assert db.execute("select array_agg(k order by k) from keys").fetchone() == ([1, 2],)


def test_values_travel_in_the_connections_client_encoding(database_url: str) -> None:
    """libpq tells the server the bytes are in the session's client_encoding: a LATIN1
    session gets LATIN1 bytes both ways, and a character LATIN1 cannot hold is refused
    with a DataError rather than sent as other characters."""
    statement = RawStatement("echo_len", "select %(v)s::text, length(%(v)s::text)")
    with psycopg.connect(database_url, autocommit=True, client_encoding="latin1") as conn:
        assert conn.info.encoding == "iso8859-1"
        assert statement.rows(conn, {"v": "zürich clé"}) == [("zürich clé", "10")]
        with pytest.raises(psycopg.DataError, match=r"client encoding 'iso8859-1'.*€"):
            statement.rows(conn, {"v": "5 €"})
        assert statement.rows(conn, {"v": "ok"}) == [("ok", "2")]


def test_a_value_holding_nul_is_refused_not_cut_short(db: psycopg.Connection[Any]) -> None:
    """libpq reads a text parameter up to its first NUL: "k\x00x" would be sent as "k"."""
    statement = RawStatement("echo", "select %(v)s::text")
    with pytest.raises(psycopg.DataError, match="NUL"):
        statement.rows(db, {"v": "k\x00x"})
    assert statement.rows(db, {"v": "k"}) == [("k",)]


def test_a_connection_that_broke_raises_operational_error_and_stays_broken(
    db: psycopg.Connection[Any], database_url: str
) -> None:
    statement = RawStatement("broken", "select %(x)s::int")
    with psycopg.connect(database_url, autocommit=True) as victim:
        statement.rows(victim, {"x": "1"})
        db.execute("select pg_terminate_backend(%s)", [victim.info.backend_pid])
        with pytest.raises(psycopg.OperationalError):
            statement.rows(victim, {"x": "2"})
        assert victim.broken
