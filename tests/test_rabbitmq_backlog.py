"""The RabbitMQ lane's publisher never publishes under a claim about to expire.

A backlog of eager triggers larger than one claim can cover is published and recorded in
bounded chunks; what its claim cannot cover is released for sweeps to claim afresh, so a
rival publisher sweeping the outbox meanwhile takes no item this one publishes too (no mass
duplicates, no stale records). Real Postgres, a real broker.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pika

from runlane import RunContext, task
from runlane.rabbitmq._publisher import OutboxPublisher
from tests.conftest import RabbitRuntimes, RunlaneFactory
from tests.helpers import (
    Conn,
    amqp_queue,
    outbox_count,
    q,
    ready_messages,
    storage_of,
    wait_until,
)


@task(id="backlog.noop")
def noop(payload: Any, context: RunContext) -> None:
    return None


def _publisher(rl: Any) -> OutboxPublisher:
    publisher = storage_of(rl).eager_publisher  # type: ignore[attr-defined]
    assert isinstance(publisher, OutboxPublisher)
    return publisher


def test_a_backlog_longer_than_its_claim_is_published_once(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, db: Conn, schema: str
) -> None:
    """3,000 runs triggered at once under a 1.5 s claim (publishing stops 1.25 s before it
    expires): the eager publisher publishes what its claim covers, releases the rest, and
    its sweeps publish that under fresh claims; a rival publisher claiming expired or
    released items every 20 ms (as another process's would) never gets one this one
    published."""
    rl = rabbit_runtime(
        amqp_url=rabbitmq_url,
        tasks=[noop],
        claim_duration=timedelta(seconds=1.5),
        publish_timeout=timedelta(seconds=1),
    )
    rl.start()
    publisher = _publisher(rl)
    storage = storage_of(rl)
    rl.trigger(noop, "connect")  # the publisher connects and declares the queue
    name = amqp_queue(schema)
    wait_until(lambda: outbox_count(db, schema) == 0, timeout=15, what="the warm-up run")

    rival: set[Any] = set()
    stop = threading.Event()

    def sweep_as_a_rival() -> None:
        while not stop.wait(0.02):
            page = storage.outbox_claim_page(50, timedelta(seconds=1.5))  # type: ignore[attr-defined]
            if page:
                rival.update(i.run_id for i in page)
                storage.outbox_published(page)  # type: ignore[attr-defined]

    thread = threading.Thread(target=sweep_as_a_rival, name="rival-publisher")
    thread.start()
    try:
        started = time.monotonic()
        handles = rl.trigger_many(noop, range(3000))
        wait_until(
            lambda: outbox_count(db, schema) == 0,
            timeout=120,
            what="the outbox to empty",
            state=lambda: (outbox_count(db, schema), publisher.stats),
        )
        took = time.monotonic() - started
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    stats = publisher.stats
    published = ready_messages(rabbitmq_url, name) - 1  # less the warm-up
    print(f"\n3000 runs in {took:.1f}s: {stats}, rival took {len(rival)}")
    # the backlog outlasted the claim: part of it was released to the sweeps
    assert stats.unclaimed > 0, stats
    assert stats.stale == 0, stats  # nothing published under a claim another took
    # every run went out once: by this publisher (to the broker) or by the rival
    assert published + len(rival) == len(handles) == 3000, (published, len(rival))
    row = db.execute(q("select count(*) from {s}.runs", schema)).fetchone()
    assert row == (3001,)


def test_items_handed_over_with_a_claim_about_to_expire_are_released_then_swept(
    make_runlane: RunlaneFactory, rabbitmq_url: str, db: Conn, schema: str
) -> None:
    """Items whose claim has less left than a publish and its record need are not
    published under it: released at once (not counted as failures), then published by the
    publisher's sweep under a fresh claim, once each."""
    rl = make_runlane(tasks=[noop])  # a producer of the environment; no publisher of its own
    storage = storage_of(rl)
    storage.outbox_enable("default", timedelta(seconds=30))  # type: ignore[attr-defined]
    rl.trigger_many(noop, range(20))
    page = storage.outbox_claim_page(100, timedelta(seconds=30))  # type: ignore[attr-defined]
    assert len(page) == 20
    publisher = OutboxPublisher(
        storage,  # type: ignore[arg-type]
        params=pika.URLParameters(rabbitmq_url),
        schema=schema,
        claim=timedelta(seconds=30),
        publish_timeout=5.0,
        delivery_limit=5,
    )
    try:
        publisher.submit(page, time.monotonic() - 29)  # as if claimed 29 s ago
        wait_until(
            lambda: outbox_count(db, schema) == 0,
            timeout=30,
            what="the outbox to empty",
            state=lambda: publisher.stats,
        )
    finally:
        publisher.close()
    assert publisher.stats.unclaimed == 20
    assert publisher.stats.published == 20
    assert publisher.stats.failed == 0
    assert publisher.stats.stale == 0
    assert ready_messages(rabbitmq_url, amqp_queue(schema)) == 20
