"""The RabbitMQ lane's publishers keep to their environment and to the claims they hold.

Issue 37: a publisher claimed the outbox items of every environment, so environment A's
publisher published environment B's runs through A's broker connection (item 7); the eager
publisher published items after their claim had expired, told by its own clock (item 9);
and an item claimed by a producer that died waited for the recovery threshold when nothing
else was pending. Real Postgres, a real broker.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import pika
import pika.exceptions
import pytest

from runlane import RunContext, task
from runlane.cli._rabbit_nodes import RabbitNode
from runlane.postgres import PostgresStorage, outbox_of
from runlane.rabbitmq._publisher import OutboxPublisher
from runlane.storage import NewRuns, OutboxItem
from runlane.testing import MovableClock
from tests.conftest import RabbitRuntimes, RunlaneFactory
from tests.helpers import Conn, amqp_queue, outbox_count, q, storage_of, wait_until


@task(id="claims.noop")
def noop(payload: Any, context: RunContext) -> None:
    return None


def _messages(amqp_url: str, name: str) -> list[dict[str, Any]] | None:
    """The bodies of the messages ready in queue ``name`` (taken off it), None when the
    queue does not exist."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = conn.channel()
        try:
            channel.queue_declare(queue=name, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == 404:
                return None
            raise
        bodies: list[dict[str, Any]] = []
        while True:
            method, _, body = channel.basic_get(name, auto_ack=True)
            if method is None or body is None:
                return bodies
            bodies.append(json.loads(body))
    finally:
        conn.close()


def _run_ids(bodies: list[dict[str, Any]] | None) -> set[uuid.UUID]:
    return {uuid.UUID(body["run_id"]) for body in bodies or []}


def _vhost_url(node: RabbitNode, vhost: str) -> str:
    node.ctl("add_vhost", vhost)
    node.ctl("set_permissions", "-p", vhost, node.user, ".*", ".*", ".*")
    base = node.amqp_url.rsplit("/", 1)[0]
    return f"{base}/{quote(vhost, safe='')}"


def test_each_environment_publishes_only_its_own_items_to_its_own_virtual_host(
    rabbitmq_node: RabbitNode,
    rabbit_runtime: RabbitRuntimes,
    make_runlane: RunlaneFactory,
    db: Conn,
    schema: str,
) -> None:
    """Two environments of one schema, each on a virtual host of its own: environment a's
    publisher (its eager triggers, its sweeps, its maintenance) publishes a's runs, to a's
    virtual host, and leaves b's items alone; b's publisher publishes b's, to b's."""
    url_a = _vhost_url(rabbitmq_node, f"{schema}-a")
    url_b = _vhost_url(rabbitmq_node, f"{schema}-b")
    a = rabbit_runtime(amqp_url=url_a, environment="a", tasks=[noop])
    a.start()
    # environment b delivers through RabbitMQ too; its items are written before any of its
    # publishers runs, by a producer without a publisher (stored unclaimed, announced)
    outbox_of(storage_of(a)).outbox_enable("b", timedelta(minutes=5))
    producer_b = make_runlane(environment="b", tasks=[noop])
    b_runs = {h.id for h in producer_b.trigger_many(noop, range(5))}
    a_runs = {h.id for h in a.trigger_many(noop, range(3))}  # eager: a's own publisher
    a.run_maintenance_once()  # a's maintenance publishes a page of what is pending
    wait_until(lambda: _pending(db, schema, "a") == 0, timeout=15, what="a's items to be published")
    a.run_maintenance_once()  # once more, after the sweep its listener started

    assert _pending(db, schema, "b") == 5  # untouched: still b's, unclaimed
    assert _run_ids(_messages(url_a, amqp_queue(schema, environment="a"))) == a_runs
    assert _messages(url_a, amqp_queue(schema, environment="b")) is None  # never declared

    b = rabbit_runtime(amqp_url=url_b, environment="b", tasks=[noop])
    b.start()
    b.run_maintenance_once()
    wait_until(lambda: _pending(db, schema, "b") == 0, timeout=15, what="b's items to be published")
    assert _run_ids(_messages(url_b, amqp_queue(schema, environment="b"))) == b_runs
    assert _messages(url_b, amqp_queue(schema, environment="a")) is None


def _pending(db: Conn, schema: str, environment: str) -> int:
    row = db.execute(
        q("select count(*) from {s}.outbox where environment = %s", schema), (environment,)
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def storage(database_url: str, schema: str, clock: MovableClock) -> Iterator[PostgresStorage]:
    """A storage on the test's clock, which a test moves to let claims expire."""
    store = PostgresStorage(
        connection_string=database_url, schema=schema, pool_max_size=3, clock=clock
    )
    store.open()
    yield store
    store.close()


def _new_runs(count: int, queue: str = "q") -> NewRuns:
    return NewRuns(
        environment="default",
        task_id="t",
        queue=queue,
        ids=[uuid.uuid4() for _ in range(count)],
        payloads=["null"] * count,
        idempotency_keys=[None] * count,
        priority=0,
        max_attempts=1,
        delay=timedelta(0),
        run_at=None,
    )


def _publisher(storage: PostgresStorage, amqp_url: str, schema: str, claim: float) -> Any:
    publisher = OutboxPublisher(
        storage,
        params=pika.URLParameters(amqp_url),
        schema=schema,
        claim=timedelta(seconds=claim),
        publish_timeout=min(5.0, claim / 2),
        delivery_limit=5,
    )
    publisher.serve("default")
    return publisher


def test_a_chunk_whose_claim_another_publisher_took_is_not_published(
    storage: PostgresStorage, rabbitmq_url: str, db: Conn, schema: str, clock: MovableClock
) -> None:
    """Items handed to the publisher whose claim expired in database time (the storage's
    clock moved past it) and were claimed by another publisher meanwhile: the publisher's
    own clock says the claim is fresh, yet it publishes none of them; the other
    publisher's claims stand."""
    storage.outbox_enable("default", timedelta(seconds=30))
    storage.run_insert_many(_new_runs(20))
    first = storage.outbox_claim_page("default", 100, timedelta(seconds=30))
    assert len(first) == 20
    clock.advance(31)
    second = storage.outbox_claim_page("default", 100, timedelta(seconds=30))  # another's
    assert {i.id for i in second} == {i.id for i in first}
    publisher = _publisher(storage, rabbitmq_url, schema, claim=30.0)
    try:
        publisher.submit(first, time.monotonic())  # as if claimed just now
        # served after the eager items were handled: nothing claimable (the other's claims)
        assert publisher.publish_pending(100, 30.0) == 0
    finally:
        publisher.close()
    stats = publisher.stats
    assert (stats.published, stats.stale, stats.lost) == (0, 0, 20), stats
    assert _messages(rabbitmq_url, amqp_queue(schema, "q")) in (None, [])
    rows = db.execute(q("select id, claim_token from {s}.outbox", schema)).fetchall()
    assert dict(rows) == {i.id: i.claim_token for i in second}


def test_a_claim_shorter_than_the_publisher_assumes_is_not_published_past(
    storage: PostgresStorage, rabbitmq_url: str, clock: MovableClock, schema: str
) -> None:
    """The environment's eager claims are shorter than the publisher's own claim duration
    (another runtime enabled the outbox with a short one): an eager item handed over after
    its claim expired in the database and was taken by a sweep is not published by the
    publisher that was handed it, whatever its own clock and claim length say."""
    storage.outbox_enable("default", timedelta(milliseconds=200))  # eager claims: 0.2 s

    class Held:
        items: list[OutboxItem]

        def submit(self, items: Sequence[OutboxItem], claimed_at: float | None = None) -> None:
            self.items = list(items)

        def close(self, timeout: float | None = None) -> None:
            pass

    held = Held()
    storage.attach_eager_publisher(held)
    storage.run_insert_many(_new_runs(3))
    assert len(held.items) == 3
    clock.advance(1)  # the eager claims expire (database time)
    taken = storage.outbox_claim_page("default", 100, timedelta(seconds=30))  # a sweep's
    assert len(taken) == 3
    publisher = _publisher(storage, rabbitmq_url, schema, claim=30.0)
    try:
        publisher.submit(held.items, time.monotonic())
        assert publisher.publish_pending(100, 30.0) == 0
    finally:
        publisher.close()
    assert (publisher.stats.published, publisher.stats.lost) == (0, 3), publisher.stats
    assert _messages(rabbitmq_url, amqp_queue(schema, "q")) in (None, [])


def test_an_item_claimed_by_a_producer_that_died_is_published_as_its_claim_expires(
    storage: PostgresStorage, database_url: str, rabbitmq_url: str, db: Conn, schema: str
) -> None:
    """A producer commits an eager trigger and dies before publishing: its items stay
    claimed, nothing else is pending and no maintenance runs. An idle publisher of the
    environment publishes them once their claim expires (a 2 s claim here), not at the
    recovery threshold; once each, never under the dead producer's claim."""
    claim = 2.0
    storage.outbox_enable("default", timedelta(seconds=claim))
    publisher = _publisher(storage, rabbitmq_url, schema, claim=claim)
    try:
        assert publisher.publish_pending(10, 30.0) == 0  # its thread runs, idle
        dead = PostgresStorage(connection_string=database_url, schema=schema, pool_max_size=1)
        dead.open()
        try:

            class Dies:
                def submit(
                    self, items: Sequence[OutboxItem], claimed_at: float | None = None
                ) -> None:
                    pass  # the process is killed before it publishes

                def close(self, timeout: float | None = None) -> None:
                    pass

            dead.attach_eager_publisher(Dies())
            runs = _new_runs(3)
            started = time.monotonic()
            dead.run_insert_many(runs)
        finally:
            dead.close()
        row = db.execute(
            q("select count(*) from {s}.outbox where claim_token is not null", schema)
        ).fetchone()
        assert row == (3,)  # claimed by the dead producer
        wait_until(
            lambda: outbox_count(db, schema) == 0,
            timeout=claim + 8.0,
            what="the dead producer's items to be published",
            state=lambda: publisher.stats,
        )
        took = time.monotonic() - started
    finally:
        publisher.close()
    print(f"\npublished {took:.2f}s after the trigger (claim {claim}s)")
    assert claim - 0.5 <= took < claim + 5.0
    assert publisher.stats.published == 3
    assert _run_ids(_messages(rabbitmq_url, amqp_queue(schema, "q"))) == set(runs.ids)
