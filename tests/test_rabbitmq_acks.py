"""The RabbitMQ lane's claims commit asynchronously (their handlers start at once) and their
deliveries are acknowledged only once the WAL is flushed past them: ``Outbox.wal_flush``
flushes past another connection's asynchronous commit, a claim is visible while its
deliveries wait unacknowledged for that flush, and a flush that fails returns them to the
broker, whose redelivery is dropped as a duplicate, never run twice. The acquirer is driven
directly, as a worker's acquiring slot drives it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from runlane.errors import StorageUnavailable
from runlane.postgres import outbox_of
from runlane.rabbitmq._consumer import RabbitAcquirer
from tests._acquirers import driven_acquirer, round_trip
from tests.conftest import RabbitRuntimes
from tests.helpers import amqp_queue, ready_messages, wait_until

RUNS = 4


@pytest.fixture
def acquirer(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str
) -> Iterator[tuple[RabbitAcquirer, Any]]:
    with driven_acquirer(
        rabbit_runtime, rabbitmq_url, "acks", concurrency=RUNS, claim_batch=RUNS, runs=RUNS
    ) as (made, runlane):
        wait_until(lambda: len(made._buffer) == RUNS, timeout=15, what="the deliveries")
        yield made, runlane


class _Gate:
    """Holds the acknowledgements' WAL flush until opened; then makes it (or fails it, as
    a flush fails when the server crashed or cannot be reached)."""

    def __init__(self, consumer: RabbitAcquirer, *, fail: bool = False) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self._real = consumer._acks._flush
        self._fail = fail
        consumer._acks._flush = self

    def __call__(self) -> None:
        self.entered.set()
        assert self.opened.wait(15), "the test never opened the gate"
        if self._fail:
            raise StorageUnavailable("the server crashed (the test's)")
        self._real()


def _statuses(db: psycopg.Connection[Any], schema: str) -> list[str]:
    rows = db.execute(f"select status from {schema}.runs order by status").fetchall()
    return [row[0] for row in rows]


def test_wal_flush_flushes_past_another_connections_asynchronous_commit(
    rabbit_runtime: RabbitRuntimes,
    rabbitmq_url: str,
    database_url: str,
    schema: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the test server commits asynchronously by default (tests/_suite.skip_disk_flushes):
    # the storage's connections commit synchronously here, as on a server left as it ships
    monkeypatch.setenv("PGOPTIONS", "-c synchronous_commit=on")
    runlane = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[])
    runlane.start()
    storage = outbox_of(runlane._life.storage)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("set synchronous_commit = off")
        conn.execute(f"create table {schema}.acks_probe (n int)")
        unflushed = 0
        for n in range(20):
            conn.execute(f"insert into {schema}.acks_probe values (%s)", (n,))
            row = conn.execute(
                "select pg_current_wal_insert_lsn(), "
                "pg_current_wal_flush_lsn() < pg_current_wal_insert_lsn()"
            ).fetchone()
            assert row is not None
            committed_to, behind = row
            unflushed += bool(behind)
            storage.wal_flush()
            flushed = conn.execute("select pg_current_wal_flush_lsn() >= %s", (committed_to,))
            assert flushed.fetchone() == (True,), f"commit {n} not flushed by wal_flush()"
    # the WAL writer flushes an asynchronous commit within wal_writer_delay (200 ms by
    # default): most of these commits were still unflushed when wal_flush() was called
    assert unflushed > 0


def test_a_claim_is_visible_at_once_and_acknowledged_only_after_the_wal_flush(
    acquirer: tuple[RabbitAcquirer, Any], db: psycopg.Connection[Any], schema: str
) -> None:
    consumer, _ = acquirer
    gate = _Gate(consumer)
    claimed = consumer.acquire(RUNS, 0)
    assert len(claimed) == RUNS
    # the claims have committed (asynchronously): other connections see them, the handlers
    # may start, and their deliveries wait for the flush, unacknowledged
    assert _statuses(db, schema) == ["running"] * RUNS
    assert gate.entered.wait(10), "no WAL flush was asked for"
    round_trip(consumer)
    assert len(consumer._unsettled) == RUNS
    assert not consumer._acks.idle()

    gate.opened.set()
    wait_until(consumer._acks.idle, timeout=10, what="the flush and the acknowledgements")
    round_trip(consumer)
    assert not consumer._unsettled
    assert consumer._acks.flushes >= 1
    assert consumer.stats.requeued == 0


def test_a_failed_flush_returns_the_deliveries_and_the_redelivery_is_a_duplicate(
    acquirer: tuple[RabbitAcquirer, Any],
    db: psycopg.Connection[Any],
    schema: str,
    rabbitmq_url: str,
) -> None:
    consumer, _ = acquirer
    gate = _Gate(consumer, fail=True)
    claimed = consumer.acquire(RUNS, 0)
    assert len(claimed) == RUNS
    assert gate.entered.wait(10), "no WAL flush was asked for"
    gate.opened.set()  # the flush fails: nothing is acknowledged, all go back
    wait_until(lambda: consumer.stats.requeued == RUNS, timeout=10, what="the deliveries returned")
    # the broker delivers them again; the claims survived (the server did not really
    # crash), so each redelivery is a duplicate: acknowledged after a flush, never run
    consumer._acks._flush = gate._real
    wait_until(lambda: len(consumer._buffer) == RUNS, timeout=15, what="the redeliveries")
    assert consumer.acquire(RUNS, 0) == []
    assert consumer.stats.duplicates == RUNS
    wait_until(consumer._acks.idle, timeout=10, what="the acknowledgements")
    round_trip(consumer)
    assert not consumer._unsettled
    assert ready_messages(rabbitmq_url, amqp_queue(schema)) == 0
    assert _statuses(db, schema) == ["running"] * RUNS
