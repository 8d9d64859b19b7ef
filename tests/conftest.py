"""Fixtures: one PostgreSQL server per test session, one fresh schema per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from runlane import Runlane, create_runlane
from runlane.postgres import apply_postgres_storage_migrations, postgres_polling_lane
from runlane.testing import start_embedded_postgres

RunlaneFactory = Callable[..., Runlane]


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """RUNLANE_TEST_DATABASE_URL when set, else an embedded server for the session."""
    configured = os.environ.get("RUNLANE_TEST_DATABASE_URL")
    if configured:
        yield configured
        return
    url, server = start_embedded_postgres()
    try:
        yield url
    finally:
        server.cleanup()


@pytest.fixture
def fresh_schema(database_url: str) -> Iterator[str]:
    """A schema name unique to this test, not migrated; dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    yield name
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(name)))


@pytest.fixture
def schema(database_url: str, fresh_schema: str) -> str:
    """A migrated schema unique to this test."""
    apply_postgres_storage_migrations(connection_string=database_url, schema=fresh_schema)
    return fresh_schema


@pytest.fixture
def db(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for test assertions and set-up."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def make_runlane(database_url: str, schema: str) -> Iterator[RunlaneFactory]:
    """Build runtimes on this test's schema; every one is closed at teardown."""
    made: list[Runlane] = []

    def make(**kwargs: Any) -> Runlane:
        lane_options = kwargs.pop("lane_options", {})
        lane = postgres_polling_lane(
            connection_string=database_url, schema=kwargs.pop("schema", schema), **lane_options
        )
        runtime = create_runlane(lane=lane, **kwargs)
        made.append(runtime)
        return runtime

    yield make
    for runtime in made:
        runtime.close()
