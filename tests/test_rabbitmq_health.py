"""status() and the console report a RabbitMQ queue the broker cannot serve.

RabbitMQ 3.10 loses a quorum queue's leader for good when its node is SIGKILLed within about
0.5 s of the queue's declaration: the queue still shows as running, declarations answer, but
every publish to it goes unconfirmed. Reproduced on a private node: the queue is declared
and the node killed at once, then restarted.
"""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import pika
import pytest
from psycopg import sql

from runlane import ConfigurationError, RunContext, task
from runlane._operator.status import unhealthy
from runlane.cli._rabbit_nodes import RabbitNode
from runlane.rabbitmq import RabbitMQStatus
from runlane.rabbitmq._amqp import Watchdog, declare_queue, queue_name
from tests.conftest import RabbitRuntimes
from tests.helpers import Conn, SchemaDb, closed_port, wait_until


@task(id="health.noop")
def noop(payload: Any, context: RunContext) -> None:
    return None


def _served(node: RabbitNode, name: str) -> bool:
    """Whether a confirmed publish to ``name`` succeeds within 1 s (cut off by runlane's
    watchdog otherwise; a probe that lands is never consumed: the test then skips). A served
    queue on loopback confirms in milliseconds, and the test's lane gives its own publishes
    1 s (publish_timeout) too; a leaderless one never does, so the probe waits its bound."""
    conn = pika.BlockingConnection(node.connection_parameters())
    watchdog = Watchdog("test-probe-watchdog")
    try:
        channel = conn.channel()
        channel.confirm_delivery()
        with watchdog.bound(conn, 1.0):
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
    return int(
        SchemaDb(db, schema).one("select coalesce(max(failures), 0) from {schema}.outbox")[0]
    )


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


# -- the start-up check -------------------------------------------------------------------------


def _with(
    url: str, *, password: str | None = None, vhost: str | None = None, user: str | None = None
) -> str:
    """``url`` with another password, virtual host or user."""
    parts = urlsplit(url)
    user = (parts.username or "guest") if user is None else user
    secret = (parts.password or "") if password is None else password
    host = f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)
    path = parts.path if vhost is None else "/" + quote(vhost, safe="")
    return urlunsplit((parts.scheme, f"{user}:{secret}@{host}", path, parts.query, ""))


def _enabled(db: Conn, schema: str) -> int:
    return int(SchemaDb(db, schema).one("select count(*) from {schema}.outbox_environments")[0])


def test_start_refuses_credentials_the_broker_refuses(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, db: Conn, schema: str
) -> None:
    secret = "not-the-password-x7q"
    rl = rabbit_runtime(amqp_url=_with(rabbitmq_url, password=secret), tasks=[noop])
    with pytest.raises(ConfigurationError) as raised:
        rl.start()
    message = str(raised.value)
    assert "refused the credentials of amqp_url" in message
    assert f"{urlsplit(rabbitmq_url).hostname}:{urlsplit(rabbitmq_url).port}" in message
    assert secret not in message
    assert _enabled(db, schema) == 0  # nothing written: the outbox was not enabled


def test_status_says_when_the_broker_stops_letting_the_runtime_in(
    rabbit_runtime: RabbitRuntimes, rabbitmq_node: RabbitNode, schema: str
) -> None:
    # a runtime started with a user the broker then deletes (credentials rotated under it)
    user, secret = f"u_{schema}"[:60], "pw-of-a-user-that-goes"
    rabbitmq_node.ctl("add_user", user, secret)
    rabbitmq_node.ctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
    rl = rabbit_runtime(
        amqp_url=_with(rabbitmq_node.amqp_url, password=secret, user=user), tasks=[noop]
    )
    rl.start()
    assert RabbitMQStatus.of(rl.status()).broker == f"reachable at 127.0.0.1:{rabbitmq_node.port}"
    rabbitmq_node.ctl("delete_user", user)
    report = RabbitMQStatus.of(rl.status())
    assert report.broker is not None
    assert report.broker.startswith(f"unreachable at 127.0.0.1:{rabbitmq_node.port}")
    assert "refused the credentials of amqp_url" in report.broker, report.broker
    assert secret not in report.broker
    assert any("refused the credentials" in problem for problem in report.problems())


def test_start_refuses_a_virtual_host_the_broker_refuses(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, db: Conn, schema: str
) -> None:
    rl = rabbit_runtime(amqp_url=_with(rabbitmq_url, vhost=f"no-such-{schema}"), tasks=[noop])
    with pytest.raises(ConfigurationError, match=r"refused access to virtual host 'no-such-"):
        rl.start()
    assert _enabled(db, schema) == 0


def test_start_goes_on_when_the_broker_is_down(
    rabbit_runtime: RabbitRuntimes, db: Conn, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    # triggers keep their outbox items in Postgres: a broker down at start is logged, and
    # the runtime starts (a producer does not wait for the broker). Down: nothing listens at
    # its port, as after a stop (stopping the lent node cost a second, and the next test on
    # it a restart)
    url = f"amqp://guest:guest@127.0.0.1:{closed_port()}/%2F"
    rl = rabbit_runtime(amqp_url=url, tasks=[noop])
    with caplog.at_level(logging.WARNING, logger="runlane.rabbitmq"):
        rl.start()
    assert any("does not answer at start" in r.getMessage() for r in caplog.records)
    assert _enabled(db, schema) == 1
    handle = rl.trigger(noop, None)
    assert rl.status().outbox_pending == 1
    assert rl.get_run(handle.id).status.value == "queued"


def test_a_broker_that_accepts_and_never_answers_holds_start_and_status_only_connect_timeout(
    rabbit_runtime: RabbitRuntimes, caplog: pytest.LogCaptureFixture
) -> None:
    # TCP is accepted (the listen backlog) and no AMQP answer comes: pika's handshake waits
    # its stack_timeout, 15 s by default, whatever connect_timeout said; the lane bounds the
    # whole handshake by connect_timeout (the start-up check and status() by 3 s at most)
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        url = f"amqp://guest:guest@127.0.0.1:{mute.getsockname()[1]}/%2F"
        rl = rabbit_runtime(amqp_url=url, tasks=[noop], connect_timeout=1.0)
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="runlane.rabbitmq"):
            rl.start()
        started = time.monotonic() - began
        assert any("does not answer at start" in r.getMessage() for r in caplog.records)
        began = time.monotonic()
        broker = RabbitMQStatus.of(rl.status()).broker
        asked = time.monotonic() - began
        assert broker is not None
        assert broker.startswith("unreachable at 127.0.0.1:"), broker
        assert started < 4.0, started
        assert asked < 4.0, asked
