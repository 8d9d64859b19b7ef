"""The RabbitMQ lane's publisher never publishes under a claim it no longer holds.

A backlog of eager triggers larger than one claim can cover is published and recorded in
bounded chunks, each under claims the database has just extended; what expired before its
chunk, or is about to expire within one, is left or released for sweeps to claim afresh, so
a rival publisher sweeping the outbox meanwhile takes no item this one publishes too (no
mass duplicates, no stale records). Real Postgres, a real broker.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pika

from runlane import RunContext, RunlaneError, task
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
    expires): the eager publisher extends the claims of each chunk before publishing it,
    leaves what expired before its chunk and releases what its claim cannot cover, and its
    sweeps publish that under fresh claims; a rival publisher claiming expired or released
    items every 20 ms (as another process's would) never gets one this one published."""
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
            page = storage.outbox_claim_page("default", 50, timedelta(seconds=1.5))  # type: ignore[attr-defined]
            if page:
                # what its record confirms is the rival's (an item whose claim it lost
                # meanwhile is not; a failed record, as a publisher's, leaves its items to
                # be swept again once its claim expires)
                try:
                    done = storage.outbox_published(page)  # type: ignore[attr-defined]
                except RunlaneError:
                    continue
                rival.update(i.run_id for i in page if i.id in done)

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
    assert stats.stale == 0, stats  # nothing published under a claim another took
    # every run went out once: by this publisher (to the broker) or by the rival
    assert published + len(rival) == len(handles) == 3000, (published, len(rival))
    row = db.execute(q("select count(*) from {s}.runs", schema)).fetchone()
    assert row == (3001,)


def test_items_handed_over_under_an_expired_claim_are_swept_afresh_and_published_once(
    make_runlane: RunlaneFactory, rabbitmq_url: str, db: Conn, schema: str
) -> None:
    """Items whose claim expired in the database before the publisher got to them (its own
    clock says they were claimed just now) are not published under it: the claim
    extension before their chunk finds it lost, and the publisher's sweep claims them
    afresh and publishes each once."""
    rl = make_runlane(tasks=[noop])  # a producer of the environment; no publisher of its own
    storage = storage_of(rl)
    storage.outbox_enable("default", timedelta(seconds=30))  # type: ignore[attr-defined]
    rl.trigger_many(noop, range(20))
    page = storage.outbox_claim_page("default", 100, timedelta(seconds=30))  # type: ignore[attr-defined]
    assert len(page) == 20
    db.execute(q("update {s}.outbox set claim_expires_at = now() - interval '1 second'", schema))
    publisher = OutboxPublisher(
        storage,  # type: ignore[arg-type]
        params=pika.URLParameters(rabbitmq_url),
        schema=schema,
        claim=timedelta(seconds=30),
        publish_timeout=5.0,
        delivery_limit=5,
    )
    publisher.serve("default")
    try:
        publisher.submit(page, time.monotonic())
        wait_until(
            lambda: outbox_count(db, schema) == 0,
            timeout=30,
            what="the outbox to empty",
            state=lambda: publisher.stats,
        )
    finally:
        publisher.close()
    assert publisher.stats.lost == 20
    assert publisher.stats.published == 20
    assert publisher.stats.failed == 0
    assert publisher.stats.stale == 0
    assert ready_messages(rabbitmq_url, amqp_queue(schema)) == 20
