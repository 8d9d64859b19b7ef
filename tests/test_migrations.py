"""Migrations: install, idempotence, concurrent deployers, ledger checks, schema names, and
what a runtime does on a schema that was never migrated (or was migrated by someone else)."""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import attrs
import psycopg
import pytest
from psycopg import sql

from runlane import (
    ConfigurationError,
    IncompatibleSchema,
    RunContext,
    Runlane,
    SchemaNotMigrated,
    create_runlane,
    task,
)
from runlane.postgres import (
    MigrationResult,
    PostgresStorage,
    apply_postgres_storage_migrations,
    postgres_polling_lane,
)
from runlane.postgres._compat import ADDITIVE, BREAKING, marker_of
from runlane.postgres._migrations import _LOCK_CLASS, _checksum, latest_version
from runlane.postgres._sql import load_migration_files, render
from tests.helpers import Conn, count_runs, poll

# A connection string that fails at once if anything tries to use it.
UNREACHABLE = "host=/nonexistent/runlane-test dbname=nothing connect_timeout=1"
# the schema version this release installs, and every migration in order
LATEST = len(load_migration_files())
ALL = tuple(range(1, LATEST + 1))
# migrations from this version on carry a compatibility marker (expand/contract)
FIRST_MARKED = 7


@attrs.frozen
class Ping:
    n: int


@task(id="ping", schema=Ping)
def ping(payload: Ping, context: RunContext) -> int:
    return payload.n


# -- helpers ----------------------------------------------------------------------------------


def schema_exists(db: Conn, name: str) -> bool:
    row = db.execute("select count(*) from pg_namespace where nspname = %s", (name,)).fetchone()
    assert row is not None
    return bool(row[0])


def relations(db: Conn, name: str) -> dict[str, str]:
    """Every relation (tables, indexes, sequences...) in the schema, by name -> relkind."""
    rows = db.execute(
        "select c.relname, c.relkind::text from pg_class c "
        "join pg_namespace n on n.oid = c.relnamespace where n.nspname = %s",
        (name,),
    ).fetchall()
    return {str(r[0]): str(r[1]) for r in rows}


def tables(db: Conn, name: str) -> set[str]:
    return {rel for rel, kind in relations(db, name).items() if kind == "r"}


def columns(db: Conn, name: str, table: str) -> list[str]:
    rows = db.execute(
        "select column_name from information_schema.columns "
        "where table_schema = %s and table_name = %s order by ordinal_position",
        (name, table),
    ).fetchall()
    return [str(r[0]) for r in rows]


def ledger(db: Conn, name: str) -> list[tuple[Any, ...]]:
    return db.execute(
        sql.SQL(
            "select version, name, checksum, applied_at from {}.runlane_migrations order by version"
        ).format(sql.Identifier(name))
    ).fetchall()


def migrate(database_url: str, name: str) -> MigrationResult:
    return apply_postgres_storage_migrations(connection_string=database_url, schema=name)


def create_ledger(db: Conn, name: str, rows: list[tuple[int, str, str]]) -> None:
    """A ledger as runlane would have made it, holding ``rows``."""
    db.execute(sql.SQL("create schema {}").format(sql.Identifier(name)))
    db.execute(
        sql.SQL(
            "create table {}.runlane_migrations (version integer primary key, name text not "
            "null, checksum text not null, applied_at timestamptz not null default now())"
        ).format(sql.Identifier(name))
    )
    for row in rows:
        db.execute(
            sql.SQL(
                "insert into {}.runlane_migrations (version, name, checksum) values (%s, %s, %s)"
            ).format(sql.Identifier(name)),
            row,
        )


def shipped_checksum() -> str:
    (_, _, text), *_ = load_migration_files()
    return hashlib.sha256(text.replace("\r\n", "\n").encode("utf-8")).hexdigest()


@pytest.fixture
def make_runtime(database_url: str) -> Iterator[Any]:
    """Runtimes on an arbitrary (possibly unmigrated) schema; closed at teardown."""
    made: list[Runlane] = []

    def make(schema_name: str) -> Runlane:
        lane = postgres_polling_lane(connection_string=database_url, schema=schema_name)
        runtime = create_runlane(lane=lane, tasks=[ping])
        made.append(runtime)
        return runtime

    yield make
    for runtime in made:
        runtime.close()


# -- applying ---------------------------------------------------------------------------------


def test_apply_to_fresh_schema_creates_tables_and_ledger(
    database_url: str, fresh_schema: str, db: Conn
) -> None:
    assert not schema_exists(db, fresh_schema)
    result = migrate(database_url, fresh_schema)
    assert result == MigrationResult(schema=fresh_schema, applied=ALL, version=LATEST)
    assert latest_version() == LATEST
    assert {"runs", "attempts", "runlane_migrations"} <= tables(db, fresh_schema)
    first, second, third, fourth, fifth, sixth, *_ = ledger(db, fresh_schema)
    assert first[:3] == (1, "initial", shipped_checksum())
    assert second[:2] == (2, "announce")
    assert third[:2] == (3, "outbox")
    assert fourth[:2] == (4, "operations")
    assert fifth[:2] == (5, "hot_path")
    assert sixth[:2] == (6, "operator")
    assert {"queue_states", "workers"} <= tables(db, fresh_schema)
    assert "lease_token" in columns(db, fresh_schema, "runs")
    assert columns(db, fresh_schema, "runlane_migrations") == [
        "version",
        "name",
        "checksum",
        "applied_at",
        "compatibility",
    ]


def test_reapplying_is_a_no_op(database_url: str, schema: str, db: Conn) -> None:
    before_ledger = ledger(db, schema)
    before_relations = relations(db, schema)
    for _ in range(2):
        result = migrate(database_url, schema)
        assert result == MigrationResult(schema=schema, applied=(), version=LATEST)
    assert ledger(db, schema) == before_ledger  # same row, same applied_at
    assert relations(db, schema) == before_relations


def install_version_1(db: Conn, name: str) -> None:
    """A schema as the release that shipped only migration 1 left it."""
    (version, migration, text), *_ = load_migration_files()
    assert (version, migration) == (1, "initial")
    create_ledger(db, name, [])
    db.execute(render(text, name).encode("utf-8"))
    db.execute(
        sql.SQL(
            "insert into {}.runlane_migrations (version, name, checksum) values (1, %s, %s)"
        ).format(sql.Identifier(name)),
        (migration, _checksum(text)),
    )


def test_version_1_schema_upgrades_in_place_keeping_its_runs(
    database_url: str, fresh_schema: str, db: Conn, make_runtime: Any
) -> None:
    install_version_1(db, fresh_schema)
    db.execute(
        sql.SQL(
            "insert into {}.runs (id, environment, task_id, queue, status, payload, "
            "max_attempts, due_at) values (%s, 'default', 'ping', 'default', 'queued', "
            "'{{\"n\": 5}}', 1, now())"
        ).format(sql.Identifier(fresh_schema)),
        (uuid.UUID(int=5),),
    )
    before = tables(db, fresh_schema)
    runtime: Runlane = make_runtime(fresh_schema)
    # a runtime of this release refuses the old schema, naming the step
    with pytest.raises(SchemaNotMigrated, match=f"version 1, this runlane needs {LATEST}"):
        runtime.get_run(uuid.UUID(int=5))

    result = migrate(database_url, fresh_schema)
    assert result == MigrationResult(schema=fresh_schema, applied=ALL[1:], version=LATEST)
    assert tables(db, fresh_schema) == before | {
        "outbox",
        "outbox_environments",
        "queue_states",
        "workers",
        "queue_flow",
        "queue_starts",
        "audit_log",
        "audit_owed",
        "stats_rollup",
        "stats_folds",
        "stats_departed",
    }
    assert [row[:2] for row in ledger(db, fresh_schema)] == [
        (version, name) for version, name, _ in load_migration_files()
    ]
    triggers = db.execute(
        "select tgname from pg_trigger t join pg_class c on c.oid = t.tgrelid "
        "join pg_namespace n on n.oid = c.relnamespace "
        "where n.nspname = %s and not t.tgisinternal order by 1",
        (fresh_schema,),
    ).fetchall()
    assert triggers == [
        ("runlane_attempts_guard_delete",),
        ("runlane_audit_log_guard_part",),
        ("runlane_audit_owed_check",),
        ("runlane_queue_states_audited",),
        ("runlane_runs_ended",),
        ("runlane_runs_guard_delete",),
        ("runlane_runs_guard_due",),
        ("runlane_runs_guard_due_insert",),
        ("runlane_runs_guard_insert",),
        ("runlane_runs_guard_tombstone",),
        ("runlane_runs_guard_transition",),
        ("runlane_runs_inserted",),
        ("runlane_runs_updated",),
        ("runlane_schedules_audited",),
        ("runlane_wait_tokens_guard_insert",),
    ]
    # the run written under version 1 is intact and runs under version 2
    assert runtime.get_run(uuid.UUID(int=5)).payload == {"n": 5}
    assert runtime.drain().runs_executed == 1
    assert runtime.get_run(uuid.UUID(int=5)).output == 5


def test_concurrent_migrators_settle_on_one_owner(
    database_url: str, fresh_schema: str, db: Conn
) -> None:
    threads = 6
    barrier = threading.Barrier(threads)
    results: list[MigrationResult] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def deploy() -> None:
        try:
            barrier.wait(timeout=30)
            result = migrate(database_url, fresh_schema)
        except BaseException as exc:
            with lock:
                errors.append(exc)
        else:
            with lock:
                results.append(result)

    workers = [threading.Thread(target=deploy) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not any(w.is_alive() for w in workers)
    assert errors == []
    assert len(results) == threads
    assert sorted(r.applied for r in results) == [(), (), (), (), (), ALL]
    assert all(r.version == LATEST and r.schema == fresh_schema for r in results)
    assert len(ledger(db, fresh_schema)) == LATEST
    assert {"runs", "attempts", "runlane_migrations"} <= tables(db, fresh_schema)


def test_different_schemas_migrate_independently(database_url: str, db: Conn) -> None:
    """A migrator holding one schema's lock does not hold up another schema's migrator."""
    first, second = (f"t_{uuid.uuid4().hex[:16]}" for _ in range(2))
    try:
        with psycopg.connect(database_url) as holder:
            # hold the first schema's migration lock the way a running deployer would
            holder.execute("select pg_advisory_xact_lock(%s, hashtext(%s))", (_LOCK_CLASS, first))

            second_result = migrate(database_url, second)  # would hang if it waited on `first`
            assert second_result.applied == ALL

            blocked: list[MigrationResult] = []
            done = threading.Event()

            def deploy_first() -> None:
                blocked.append(migrate(database_url, first))
                done.set()

            thread = threading.Thread(target=deploy_first)
            thread.start()

            # the first schema's migrator must queue behind the holder
            def waiting() -> bool:
                if _advisory_waiter(db):
                    return True
                assert not done.is_set(), "first migrator did not wait for its schema's lock"
                return False

            assert poll(waiting, timeout=30, interval=0.01), (
                "first migrator never waited on its lock"
            )
            assert not done.is_set()
            assert not schema_exists(db, first)
        # the holder's transaction ended: the waiting migrator proceeds
        thread.join(timeout=30)
        assert done.is_set()
        assert blocked == [MigrationResult(schema=first, applied=ALL, version=LATEST)]
        assert len(ledger(db, first)) == LATEST
        assert len(ledger(db, second)) == LATEST
        db.execute(
            sql.SQL(
                "insert into {}.runs (id, environment, task_id, queue, status, payload, "
                "max_attempts, due_at) values (gen_random_uuid(), 'e', 't', 'q', 'queued', "
                "'{{}}', 1, now())"
            ).format(sql.Identifier(first))
        )
        assert (count_runs(db, first), count_runs(db, second)) == (1, 0)
    finally:
        for name in (first, second):
            db.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(name)))


def _advisory_waiter(db: Conn) -> bool:
    row = db.execute(
        "select count(*) from pg_locks where locktype = 'advisory' and not granted "
        "and classid = %s::oid",
        (_LOCK_CLASS,),
    ).fetchone()
    assert row is not None
    return bool(row[0])


# -- schema names -----------------------------------------------------------------------------

BAD_NAMES: list[Any] = [
    "Runlane",
    "a-b",
    "x; drop table y",
    "",
    "pg_x",
    "pg_catalog",
    "information_schema",
    "a" * 64,
    "1abc",
    "caf\u00e9",
    'a"b',
    None,
    42,
    b"runlane",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_bad_schema_names_are_rejected_before_connecting(
    database_url: str, db: Conn, name: Any
) -> None:
    watched = [name, name.lower(), "x"] if isinstance(name, str) else []
    existed = {n: (schema_exists(db, n), relations(db, n)) for n in watched}
    # an unreachable server proves the name is checked before any connection is attempted
    with pytest.raises(ConfigurationError, match="schema name"):
        apply_postgres_storage_migrations(connection_string=UNREACHABLE, schema=name)
    with pytest.raises(ConfigurationError, match="schema name"):
        apply_postgres_storage_migrations(connection_string=database_url, schema=name)
    with pytest.raises(ConfigurationError, match="schema name"):
        postgres_polling_lane(connection_string=database_url, schema=name)
    with pytest.raises(ConfigurationError, match="schema name"):
        PostgresStorage(connection_string=database_url, schema=name)
    # nothing was created, in the named schema or in a lowercased or truncated look-alike
    assert {n: (schema_exists(db, n), relations(db, n)) for n in watched} == existed


@pytest.mark.parametrize("name", ["runlane", "_private", "a" * 63, "r2_d2"])
def test_good_schema_names_are_accepted(database_url: str, db: Conn, name: str) -> None:
    existed = schema_exists(db, name)
    try:
        assert migrate(database_url, name).version == LATEST
        assert "runs" in tables(db, name)
    finally:
        if not existed:
            db.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(name)))


@pytest.mark.parametrize("name", ["runlane\n", "a" * 63 + "\n"], ids=["short", "long"])
def test_schema_name_with_trailing_newline_is_rejected(database_url: str, name: str) -> None:
    with pytest.raises(ConfigurationError, match="schema name"):
        apply_postgres_storage_migrations(connection_string=UNREACHABLE, schema=name)


# -- ledgers this release does not recognise --------------------------------------------------


def test_unknown_newer_version_is_rejected_and_changes_nothing(
    database_url: str, schema: str, db: Conn
) -> None:
    db.execute(
        sql.SQL(
            "insert into {}.runlane_migrations (version, name, checksum) "
            "values (99, 'future', 'abc')"
        ).format(sql.Identifier(schema))
    )
    before_ledger = ledger(db, schema)
    before_relations = relations(db, schema)
    with pytest.raises(IncompatibleSchema, match="99"):
        migrate(database_url, schema)
    assert ledger(db, schema) == before_ledger
    assert relations(db, schema) == before_relations


@pytest.mark.parametrize(
    "row",
    [
        (1, "initial", "0" * 64),  # an older release shipped different SQL as version 1
        (1, "bootstrap", None),  # same SQL recorded under another name
    ],
    ids=["checksum", "name"],
)
def test_ledger_from_another_release_is_rejected(
    database_url: str, fresh_schema: str, db: Conn, row: tuple[int, str, str | None]
) -> None:
    version, name, checksum = row
    create_ledger(db, fresh_schema, [(version, name, checksum or shipped_checksum())])
    before_ledger = ledger(db, fresh_schema)
    with pytest.raises(IncompatibleSchema, match="fresh schema"):
        migrate(database_url, fresh_schema)
    assert ledger(db, fresh_schema) == before_ledger
    assert tables(db, fresh_schema) == {"runlane_migrations"}


def test_tampered_checksum_after_migrating_is_rejected(
    database_url: str, schema: str, db: Conn
) -> None:
    db.execute(
        sql.SQL("update {}.runlane_migrations set checksum = 'older'").format(
            sql.Identifier(schema)
        )
    )
    before = relations(db, schema)
    with pytest.raises(IncompatibleSchema, match="checksum"):
        migrate(database_url, schema)
    assert relations(db, schema) == before


def test_foreign_table_named_like_the_ledger_is_rejected(
    database_url: str, fresh_schema: str, db: Conn
) -> None:
    db.execute(sql.SQL("create schema {}").format(sql.Identifier(fresh_schema)))
    db.execute(
        sql.SQL("create table {}.runlane_migrations (id serial primary key, note text)").format(
            sql.Identifier(fresh_schema)
        )
    )
    before = relations(db, fresh_schema)
    with pytest.raises(IncompatibleSchema, match="did not create"):
        migrate(database_url, fresh_schema)
    assert relations(db, fresh_schema) == before
    assert columns(db, fresh_schema, "runlane_migrations") == ["id", "note"]


@pytest.mark.parametrize(
    "ddl",
    [
        "create table {}.runlane_migrations ()",
        "create sequence {}.runlane_migrations",
        "create materialized view {}.runlane_migrations as select 1 as version",
    ],
    ids=["zero-column table", "sequence", "materialized view"],
)
def test_foreign_relation_without_columns_named_like_the_ledger_is_rejected(
    database_url: str, fresh_schema: str, db: Conn, ddl: str
) -> None:
    db.execute(sql.SQL("create schema {}").format(sql.Identifier(fresh_schema)))
    db.execute(sql.SQL(ddl).format(sql.Identifier(fresh_schema)))
    before = relations(db, fresh_schema)
    with pytest.raises(IncompatibleSchema, match="runlane_migrations"):
        migrate(database_url, fresh_schema)
    assert relations(db, fresh_schema) == before


@pytest.mark.parametrize("existing", ["runs", "attempts"])
def test_existing_runlane_table_without_ledger_is_rejected_and_rolled_back(
    database_url: str, fresh_schema: str, db: Conn, existing: str
) -> None:
    db.execute(sql.SQL("create schema {}").format(sql.Identifier(fresh_schema)))
    db.execute(
        sql.SQL("create table {}.{} (something text)").format(
            sql.Identifier(fresh_schema), sql.Identifier(existing)
        )
    )
    before = relations(db, fresh_schema)
    with pytest.raises(IncompatibleSchema, match="no ledger"):
        migrate(database_url, fresh_schema)
    # the whole transaction rolled back: no ledger, no half of migration 1
    assert relations(db, fresh_schema) == before
    assert columns(db, fresh_schema, existing) == ["something"]


# -- runtimes on schemas that are not ready ---------------------------------------------------


@pytest.mark.parametrize("state", ["missing", "empty", "empty_ledger"])
def test_runtime_on_unmigrated_schema_names_the_migration_step(
    database_url: str, fresh_schema: str, db: Conn, make_runtime: Any, state: str
) -> None:
    if state == "empty":
        db.execute(sql.SQL("create schema {}").format(sql.Identifier(fresh_schema)))
    elif state == "empty_ledger":
        create_ledger(db, fresh_schema, [])
    before = relations(db, fresh_schema)

    runtime: Runlane = make_runtime(fresh_schema)
    runtime.start()  # opens connections only; never inspects the schema
    runtime.start()
    assert schema_exists(db, fresh_schema) == (state != "missing")

    calls: list[Any] = [
        lambda: runtime.trigger(ping, Ping(n=1)),
        lambda: runtime.trigger_many(ping, [Ping(n=1), Ping(n=2)]),
        lambda: runtime.get_run(uuid.uuid4()),
        runtime.drain,
        runtime.run_maintenance_once,
    ]
    for call in calls:
        with pytest.raises(SchemaNotMigrated, match="runlane migrate") as info:
            call()
        assert fresh_schema in str(info.value)

    with psycopg.connect(database_url) as own:
        with pytest.raises(SchemaNotMigrated, match="runlane migrate"):
            runtime.trigger(ping, Ping(n=1), connection=own)
        own.rollback()

    assert not [t for t in threading.enumerate() if t.name.startswith("runlane-drain-leases")]
    assert relations(db, fresh_schema) == before  # nothing was created on the way
    assert schema_exists(db, fresh_schema) == (state != "missing")

    # once the deployment step has run, the same runtime works without a restart
    migrate(database_url, fresh_schema)
    handle = runtime.trigger(ping, Ping(n=7))
    assert runtime.get_run(handle.id).payload == {"n": 7}
    assert runtime.drain().runs_executed == 1


def test_trigger_with_connection_on_unmigrated_schema_before_any_other_use(
    database_url: str, fresh_schema: str, make_runtime: Any
) -> None:
    runtime: Runlane = make_runtime(fresh_schema)
    with psycopg.connect(database_url) as own:
        with pytest.raises(SchemaNotMigrated, match="runlane migrate"):
            runtime.trigger(ping, Ping(n=1), connection=own)
        # the caller's transaction was not touched and is still usable
        row = own.execute("select 1").fetchone()
        assert row == (1,)


def test_runtime_on_newer_schema_is_incompatible(
    database_url: str, schema: str, db: Conn, make_runtime: Any
) -> None:
    db.execute(
        sql.SQL(
            "insert into {}.runlane_migrations (version, name, checksum) "
            "values (99, 'future', 'abc')"
        ).format(sql.Identifier(schema))
    )
    runtime: Runlane = make_runtime(schema)
    runtime.start()
    calls: list[Any] = [
        lambda: runtime.trigger(ping, Ping(n=1)),
        lambda: runtime.get_run(uuid.uuid4()),
        runtime.drain,
        runtime.run_maintenance_once,
    ]
    for call in calls:
        with pytest.raises(IncompatibleSchema, match="upgrade runlane"):
            call()
    with psycopg.connect(database_url) as own:
        with pytest.raises(IncompatibleSchema):
            runtime.trigger(ping, Ping(n=1), connection=own)
        own.rollback()
    assert count_runs(db, schema) == 0


def test_runtime_on_foreign_ledger_is_incompatible(
    fresh_schema: str, db: Conn, make_runtime: Any
) -> None:
    db.execute(sql.SQL("create schema {}").format(sql.Identifier(fresh_schema)))
    db.execute(
        sql.SQL("create table {}.runlane_migrations (id integer)").format(
            sql.Identifier(fresh_schema)
        )
    )
    runtime: Runlane = make_runtime(fresh_schema)
    with pytest.raises(IncompatibleSchema):
        runtime.trigger(ping, Ping(n=1))


def test_start_does_not_create_the_schema(fresh_schema: str, db: Conn, make_runtime: Any) -> None:
    runtime: Runlane = make_runtime(fresh_schema)
    runtime.start()
    assert not schema_exists(db, fresh_schema)
    runtime.close()
    assert not schema_exists(db, fresh_schema)


# -- the row checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("columns", "broken"),
    [
        ({"status": "done"}, "runs_status_known"),
        ({"status": "running"}, "runs_lease_matches_status"),  # a running run without a lease
        ({"lease_token": uuid.uuid4()}, "runs_lease_matches_status"),  # a queued one with one
        ({"status": "failed"}, "runs_finished_when_terminal"),
        ({"finished_at": "2026-01-01T00:00:00Z"}, "runs_finished_when_terminal"),
        ({"status": "waiting"}, "runs_wait_shape"),
        ({"attempt": 1, "releases": 2}, "runs_attempts_sane"),
        ({"remaining_children": 1}, "runs_tombstone_shape"),
        ({}, None),
        ({"status": "running", "lease_token": uuid.uuid4()}, None),
        ({"status": "cancellation_requested"}, None),  # its lease may have been released
        ({"status": "cancelled", "finished_at": "2026-01-01T00:00:00Z"}, None),
    ],
)
def test_the_row_checks_refuse_rows_no_statement_should_write(
    db: Conn, schema: str, columns: dict[str, Any], broken: str | None
) -> None:
    row: dict[str, Any] = {
        "id": uuid.uuid4(),
        "environment": "default",
        "task_id": "ping",
        "queue": "default",
        "status": "queued",
        "payload": "{}",
        "max_attempts": 1,
        **columns,
    }
    insert = sql.SQL("insert into {}.runs ({}, due_at) values ({}, now())").format(
        sql.Identifier(schema),
        sql.SQL(", ").join(map(sql.Identifier, row)),
        sql.SQL(", ").join(sql.Placeholder() * len(row)),
    )
    if broken is None:
        db.execute(insert, list(row.values()))
        assert count_runs(db, schema) == 1
        return
    with pytest.raises(psycopg.errors.CheckViolation) as raised:
        db.execute(insert, list(row.values()))
    assert raised.value.diag.constraint_name == broken
    assert count_runs(db, schema) == 0


# -- expand/contract: newer schemas a runtime may run on --------------------------------------


def add_newer_migration(db: Conn, schema_name: str, compatibility: str | None) -> int:
    """Record in the ledger a migration one version past this release (as a newer release's
    runner would), with ``compatibility``; returns its version."""
    version = LATEST + 1
    db.execute(
        sql.SQL(
            "insert into {}.runlane_migrations (version, name, checksum, compatibility) "
            "values (%s, 'from_the_future', 'abc', %s)"
        ).format(sql.Identifier(schema_name)),
        (version, compatibility),
    )
    return version


def test_every_migration_from_version_7_is_marked() -> None:
    """The rule of sql/migrations/README.md: each migration says whether runtimes of the
    versions before it keep working (an unmarked one would count as breaking)."""
    for version, name, text in load_migration_files():
        if version < FIRST_MARKED:
            continue
        assert re.search(r"^-- compatibility: (additive|breaking)$", text, re.MULTILINE), (
            f"migration {version:04d}_{name}.sql has no '-- compatibility: additive' or "
            "'-- compatibility: breaking' line (see runlane/postgres/sql/migrations/README.md)"
        )


def test_the_marker_is_read_and_left_out_of_the_checksum() -> None:
    body = "create table {schema}.x (id int);\n"
    assert marker_of("-- compatibility: additive\n" + body) == ADDITIVE
    assert marker_of("-- compatibility: breaking\n" + body) == BREAKING
    assert marker_of(body) == BREAKING  # unmarked counts as breaking
    assert marker_of("-- compatibility: additive-ish\n" + body) == BREAKING
    assert _checksum("-- compatibility: additive\n" + body) == _checksum(body)
    assert _checksum(body) == hashlib.sha256(body.encode()).hexdigest()


def test_the_ledger_records_each_migrations_marker(schema: str, db: Conn) -> None:
    rows = db.execute(
        sql.SQL("select version, compatibility from {}.runlane_migrations order by 1").format(
            sql.Identifier(schema)
        )
    ).fetchall()
    assert rows == [(version, marker_of(text)) for version, _, text in load_migration_files()]


def test_a_ledger_from_before_the_column_gets_it_and_its_markers(
    database_url: str, schema: str, db: Conn
) -> None:
    ledger_table = sql.SQL("{}.runlane_migrations").format(sql.Identifier(schema))
    db.execute(sql.SQL("alter table {} drop column compatibility").format(ledger_table))
    before = ledger(db, schema)
    assert migrate(database_url, schema).applied == ()
    assert ledger(db, schema) == before
    rows = db.execute(
        sql.SQL("select version, compatibility from {} order by 1").format(ledger_table)
    ).fetchall()
    assert rows == [(version, marker_of(text)) for version, _, text in load_migration_files()]


def test_runtime_runs_on_a_newer_additive_schema_and_says_so(
    schema: str, db: Conn, make_runtime: Any, caplog: pytest.LogCaptureFixture
) -> None:
    version = add_newer_migration(db, schema, ADDITIVE)
    runtime: Runlane = make_runtime(schema)
    with caplog.at_level(logging.INFO, logger="runlane.postgres"):
        handle = runtime.trigger(ping, Ping(n=3))
        assert runtime.drain().runs_executed == 1
    assert runtime.get_run(handle.id).output == 3
    notes = [r.getMessage() for r in caplog.records if "additive" in r.getMessage()]
    assert len(notes) == 1, notes  # once per runtime, not per statement
    assert f"at version {version}, newer than this runlane's {LATEST}" in notes[0]
    assert f"{version} (from_the_future)" in notes[0]


@pytest.mark.parametrize("compatibility", [BREAKING, None], ids=["breaking", "unmarked"])
def test_runtime_refuses_a_newer_breaking_schema_naming_the_migration(
    schema: str, db: Conn, make_runtime: Any, compatibility: str | None
) -> None:
    version = add_newer_migration(db, schema, compatibility)
    runtime: Runlane = make_runtime(schema)
    with pytest.raises(IncompatibleSchema) as caught:
        runtime.trigger(ping, Ping(n=1))
    message = str(caught.value)
    assert f"migration {version} (from_the_future) is marked breaking" in message
    assert "upgrade runlane" in message
    assert count_runs(db, schema) == 0


def test_migrating_under_a_newer_additive_schema_changes_nothing(
    database_url: str, schema: str, db: Conn
) -> None:
    """A rolled-back application's deploy step may run the migrator of the older release:
    on an additive newer schema it has nothing to do and says where the schema stands."""
    version = add_newer_migration(db, schema, ADDITIVE)
    before = ledger(db, schema), relations(db, schema)
    result = migrate(database_url, schema)
    assert result == MigrationResult(schema=schema, applied=(), version=version)
    assert (ledger(db, schema), relations(db, schema)) == before


def test_migrating_under_a_newer_breaking_schema_is_refused(
    database_url: str, schema: str, db: Conn
) -> None:
    version = add_newer_migration(db, schema, BREAKING)
    before = ledger(db, schema), relations(db, schema)
    with pytest.raises(IncompatibleSchema, match=f"migration {version} .* breaking"):
        migrate(database_url, schema)
    assert (ledger(db, schema), relations(db, schema)) == before
