"""The RabbitMQ lane's ``queue_type``: quorum queues by default, classic ones on request (one
node, delivered before their disk write), refused values, and a queue the broker already
holds with the other type (refused by the broker, said so in the item's error and the
worker's log, nothing published into the wrong queue).

Tests share the session broker (``rabbitmq_url``); queue names carry the test's schema."""

from __future__ import annotations

import logging
from typing import Any

import pika
import pika.exceptions
import psycopg
import pytest

from runlane import ConfigurationError, RunContext, RunStatus, task
from runlane.rabbitmq import RabbitMQStatus, rabbitmq_lane
from runlane.rabbitmq._amqp import declare_queue
from tests.conftest import RabbitRuntimes
from tests.helpers import (
    Executions,
    amqp_queue,
    consumer_ready,
    logged,
    outbox_count,
    q,
    ready_messages,
    wait_until,
)

Conn = psycopg.Connection[Any]


def _declared_type(amqp_url: str, schema: str, queue_type: str) -> bool:
    """Whether the broker holds the schema's default queue with ``queue_type``: declaring it
    as the lane does with that type succeeds, or the broker refuses it (406)."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    refused: int | None = None
    try:
        declare_queue(conn.channel(), schema, amqp_queue(schema), 20, queue_type)
    except pika.exceptions.ChannelClosedByBroker as exc:
        refused = exc.reply_code
    finally:
        conn.close()
    assert refused in {None, 406}, refused
    return refused is None


@pytest.mark.parametrize("value", ["stream", "Quorum", "", None, 1])
def test_an_unknown_queue_type_is_refused_with_the_choices(value: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"queue_type must be one of 'quorum', 'classic'"):
        rabbitmq_lane(
            connection_string="postgresql://localhost/x",
            amqp_url="amqp://guest:guest@localhost/",
            queue_type=value,
        )


def test_the_default_is_quorum() -> None:
    lane = rabbitmq_lane(
        connection_string="postgresql://localhost/x", amqp_url="amqp://guest:guest@localhost/"
    )
    assert lane.queue_type == "quorum"


def test_classic_queues_carry_runs_each_once(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, schema: str, db: Conn
) -> None:
    executions = Executions()
    classic = executions.task("queue_type.classic")

    rl = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[classic], queue_type="classic")
    worker = rl.create_delivery_worker(concurrency=2)
    consumer_ready(worker)
    handles = [rl.trigger(classic, n) for n in range(5)]
    handles += rl.trigger_many(classic, list(range(5, 30)))
    for handle in handles:
        assert rl.wait_for_run(handle.id, timeout=15).status is RunStatus.COMPLETED
    assert not executions.more_than_once()
    assert len(executions.runs) == 30
    assert outbox_count(db, schema) == 0
    assert _declared_type(rabbitmq_url, schema, "classic")
    assert not _declared_type(rabbitmq_url, schema, "quorum")


def test_a_queue_held_with_the_other_type_is_refused_and_said_so(
    rabbit_runtime: RabbitRuntimes,
    rabbitmq_url: str,
    schema: str,
    db: Conn,
    caplog: pytest.LogCaptureFixture,
) -> None:
    @task(id="queue_type.mismatch")
    def mismatch(payload: int, context: RunContext) -> int:
        return payload

    quorum = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[mismatch])
    first = quorum.trigger(mismatch, 1)  # its publisher declares the quorum queue
    wait_until(lambda: outbox_count(db, schema) == 0, timeout=15, what="the first published")
    quorum.close(timeout=10)

    caplog.set_level(logging.WARNING, logger="runlane.rabbitmq")
    classic = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[mismatch], queue_type="classic")
    refused = classic.trigger(mismatch, 2)

    def last_error() -> str | None:
        row = db.execute(
            q("select last_error from {s}.outbox where run_id = %s", schema), (refused.id,)
        ).fetchone()
        return None if row is None else row[0]

    wait_until(lambda: last_error() is not None, timeout=15, what="the failed publish recorded")
    error = last_error()
    assert error is not None
    assert "queue_type='classic'" in error
    assert "x-queue-type" in error  # the broker's own words
    assert "cannot change" in error

    with logged("cannot consume") as said:
        worker = classic.create_delivery_worker(concurrency=1)
        assert said.wait(15), "the worker did not say why it cannot consume"
    assert not worker.acquirer.consuming.is_set()  # type: ignore[attr-defined]
    worker.close(timeout=10)
    # nothing went into a queue of the wrong type: the quorum queue holds the first run only,
    # and it is still a quorum queue
    assert _declared_type(rabbitmq_url, schema, "quorum")
    assert ready_messages(rabbitmq_url, amqp_queue(schema)) == 1
    assert classic.get_run(first.id).status is RunStatus.QUEUED
    assert classic.get_run(refused.id).status is RunStatus.QUEUED
    # status names the queue and the cause once an item failed twice (no quorum-leader hint)
    db.execute(
        q("update {s}.outbox set failures = greatest(failures, 2) where run_id = %s", schema),
        (refused.id,),
    )
    problems = RabbitMQStatus.of(classic.status()).broker_problems
    assert len(problems) == 1, problems
    assert amqp_queue(schema) in problems[0]
    assert "another type than this runtime's queue_type" in problems[0]
    assert "quorum_status" not in problems[0]
