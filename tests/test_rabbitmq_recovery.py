"""A queue deleted under a running lane comes back: the publisher declares it again after an
unroutable publish, and a consumer the broker cancelled reconnects and consumes it anew."""

from __future__ import annotations

import pika
import psycopg

from runlane import RunContext, RunStatus, create_runlane, task
from runlane.rabbitmq import rabbitmq_lane
from tests.helpers import amqp_queue, consumer_ready, outbox_count, wait_until


@task(id="noop")
def noop(payload: None, context: RunContext) -> str:
    return "done"


def test_a_deleted_queue_is_declared_and_consumed_again(
    database_url: str, schema: str, rabbitmq_url: str, db: psycopg.Connection[object]
) -> None:
    lane = rabbitmq_lane(connection_string=database_url, schema=schema, amqp_url=rabbitmq_url)
    rl = create_runlane(lane=lane, tasks=[noop])
    try:
        with rl.create_delivery_worker(concurrency=2) as worker:
            consumer_ready(worker)
            first = rl.trigger(noop, None)
            assert rl.wait_for_run(first.id, timeout=10).status is RunStatus.COMPLETED
            with pika.BlockingConnection(pika.URLParameters(rabbitmq_url)) as conn:
                conn.channel().queue_delete(queue=amqp_queue(schema))
            second = rl.trigger(noop, None)
            snap = rl.wait_for_run(second.id, timeout=30)
            assert snap.status is RunStatus.COMPLETED
        wait_until(lambda: outbox_count(db, schema) == 0, timeout=10, what="an empty outbox")
    finally:
        rl.close(timeout=10)
