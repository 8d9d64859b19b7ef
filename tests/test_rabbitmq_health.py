"""status() and the console report a RabbitMQ queue the broker cannot serve.

RabbitMQ 3.10 loses a quorum queue's leader for good when its node is SIGKILLed within about
0.5 s of the queue's declaration: the queue still shows as running, declarations answer, but
every publish to it goes unconfirmed. Reproduced on a private node: the queue is declared
and the node killed at once, then restarted.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pika
import pytest
from psycopg import sql

from runlane import RunContext, task
from runlane._rabbit_nodes import RabbitNode
from runlane._status import unhealthy
from runlane.rabbitmq import RabbitMQStatus
from runlane.rabbitmq._amqp import Watchdog, declare_queue, queue_name
from tests.conftest import RabbitRuntimes
from tests.helpers import Conn, wait_until


@task(id="health.noop")
def noop(payload: Any, context: RunContext) -> None:
    return None


def _served(node: RabbitNode, name: str) -> bool:
    """Whether a confirmed publish to ``name`` succeeds within 3 s (cut off by runlane's
    watchdog otherwise; a probe that lands is never consumed: the test then skips)."""
    conn = pika.BlockingConnection(node.connection_parameters())
    watchdog = Watchdog("test-probe-watchdog")
    try:
        channel = conn.channel()
        channel.confirm_delivery()
        with watchdog.bound(conn, 3.0):
            channel.basic_publish("", name, b"probe", mandatory=True)
    except pika.exceptions.AMQPError:
        return False
    else:
        return True
    finally:
        watchdog.stop()
        if conn.is_open:
            conn.close()


def _max_failures(db: Conn, schema: str) -> int:
    row = db.execute(
        sql.SQL("select coalesce(max(failures), 0) from {}.outbox").format(sql.Identifier(schema))
    ).fetchone()
    return int(row[0]) if row else 0


def test_a_quorum_queue_without_a_leader_is_reported_unhealthy(
    rabbitmq_node: RabbitNode, rabbit_runtime: RabbitRuntimes, db: Conn, schema: str
) -> None:
    node = rabbitmq_node
    name = queue_name(schema, "default", "default")
    conn = pika.BlockingConnection(node.connection_parameters())
    declare_queue(conn.channel(), schema, name, 20)
    conn.close()
    node.kill()  # within 0.5 s of the declaration
    node.start()
    if _served(node, name):
        pytest.skip("this RabbitMQ kept the quorum queue's leader (the 3.10 limit is gone)")
    rl = rabbit_runtime(
        amqp_url=node.amqp_url,
        tasks=[noop],
        publish_timeout=timedelta(seconds=1),
        claim_duration=timedelta(seconds=30),
    )
    assert RabbitMQStatus.of(rl.status()).broker_problems == ()
    rl.trigger_many(noop, [None] * 3)  # published after commit: each try times out
    wait_until(
        lambda: _max_failures(db, schema) >= 2,
        timeout=30,
        what="two failed publishes",
        state=lambda: _max_failures(db, schema),
    )
    report = rl.status()
    status = RabbitMQStatus.of(report)
    assert status.broker is not None
    assert status.broker.startswith("reachable")
    (problem,) = status.broker_problems
    assert f"RabbitMQ queue {name} (runlane queue 'default') cannot be served" in problem
    assert "3 runs wait to be published" in problem
    assert "no confirm within 1s" in problem
    assert f"rabbitmqctl delete_queue {name}" in problem
    assert problem in unhealthy(report)
    # the console's health list says the same
    from runlane.web import create_app  # noqa: PLC0415 - needs flask

    page = create_app(rl).test_client().get("/").get_data(as_text=True)
    assert f"RabbitMQ queue {name}" in page
    # what the message says to do: delete the queue; runlane declares it again and publishes
    node.ctl("delete_queue", name)
    with db.transaction():  # due now, rather than waiting out the back-off
        db.execute(
            sql.SQL("update {}.outbox set available_at = now()").format(sql.Identifier(schema))
        )
    wait_until(
        lambda: rl.run_maintenance_once().outbox_published >= 0 and not rl.status().outbox_pending,
        timeout=30,
        what="the runs published once the queue was declared again",
    )
    assert RabbitMQStatus.of(rl.status()).broker_problems == ()
