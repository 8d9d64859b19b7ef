"""A broker that accepts the connection but never answers cannot block the publisher: each
publish and its confirm are bounded by ``publish_timeout`` (pika bounds neither), the items
are released for a later try, and they are delivered once the broker answers again."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from runlane import RunContext, RunStatus, create_runlane, task
from runlane.rabbitmq import rabbitmq_lane
from tests._proxy import TcpProxy
from tests.helpers import consumer_ready, logged, outbox_count, q, wait_until


@task(id="noop")
def noop(payload: None, context: RunContext) -> str:
    return "done"


def test_a_silent_broker_cannot_block_the_publisher(
    database_url: str,
    schema: str,
    rabbitmq_url: str,
    db: psycopg.Connection[tuple[Any, ...]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    params = conninfo_to_dict(rabbitmq_url.replace("amqp://", "postgresql://"))
    proxy = TcpProxy(str(params["host"]), int(str(params["port"])))
    proxy.up()
    through_proxy = rabbitmq_url.replace(f":{params['port']}/", f":{proxy.port}/")
    producer = create_runlane(
        lane=rabbitmq_lane(
            connection_string=database_url,
            schema=schema,
            amqp_url=through_proxy,
            publish_timeout=timedelta(seconds=1),
            claim_duration=timedelta(seconds=30),
        ),
        tasks=[noop],
    )
    direct = create_runlane(
        lane=rabbitmq_lane(connection_string=database_url, schema=schema, amqp_url=rabbitmq_url),
        tasks=[noop],
    )
    try:
        with direct.create_delivery_worker(concurrency=2) as worker:
            consumer_ready(worker)
            first = producer.trigger(noop, None)
            assert producer.wait_for_run(first.id, timeout=10).status is RunStatus.COMPLETED
            proxy.stall()
            with (
                caplog.at_level(logging.WARNING, logger="runlane"),
                logged("passed its deadline") as cut_off,
            ):
                stuck = producer.trigger(noop, None)
                assert cut_off.wait(10), "the publisher's watchdog did not cut the broker off"

            def released() -> bool:
                row = db.execute(
                    q("select failures from {s}.outbox where run_id = %s", schema), (stuck.id,)
                ).fetchone()
                return row is not None and int(row[0]) >= 1

            # released for a later try, not lost (and the publisher thread lives on)
            wait_until(released, timeout=15, what="the unpublished item to be released")
            proxy.unstall()
            snap = producer.wait_for_run(stuck.id, timeout=30)
            assert snap.status is RunStatus.COMPLETED
        wait_until(lambda: outbox_count(db, schema) == 0, timeout=10, what="an empty outbox")
    finally:
        producer.close(timeout=10)
        direct.close(timeout=10)
        proxy.close()
