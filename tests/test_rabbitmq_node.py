"""The RabbitMQ brokers the tests and the demo use: a private node on loopback (quorum queues
with a delivery limit and dead-lettering, confirms, kill and restart keeping persistent
messages) and the skip-or-fail rule when the broker package is missing. The three-node
cluster's own test is in test_rabbitmq_cluster.py, beside the lane's, so the suite starts one
cluster, not two."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika  # type: ignore[import-untyped, unused-ignore]
import pika.exceptions  # type: ignore[import-untyped, unused-ignore]
import pytest

import runlane.cli._rabbit_host
from runlane.cli._rabbit_host import (
    RABBITMQ_INSTALL_COMMAND,
    port_open,
    rabbitmq_available,
    rabbitmq_test_verdict,
)
from runlane.cli._rabbit_nodes import RabbitNode, create_rabbitmq_node
from tests.conftest import require_rabbitmq
from tests.helpers import drain_messages

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _channel(connection: Any) -> Any:
    channel = connection.channel()
    channel.confirm_delivery()  # basic_publish raises unless the broker confirms
    return channel


@pytest.fixture
def connection(rabbitmq_url: str) -> Iterator[Any]:
    conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        yield conn
    finally:
        if conn.is_open:
            conn.close()


def test_quorum_queue_with_delivery_limit_and_dead_letter_exchange(connection: Any) -> None:
    name = f"t.{uuid.uuid4().hex[:12]}"
    channel = _channel(connection)
    channel.exchange_declare(f"{name}.dlx", exchange_type="fanout", durable=True)
    channel.queue_declare(f"{name}.dead", durable=True, arguments={"x-queue-type": "quorum"})
    channel.queue_bind(f"{name}.dead", f"{name}.dlx")
    channel.queue_declare(
        name,
        durable=True,
        arguments={
            "x-queue-type": "quorum",
            "x-delivery-limit": 2,
            "x-dead-letter-exchange": f"{name}.dlx",
        },
    )
    try:
        channel.basic_publish("", name, b"hello", PERSISTENT, mandatory=True)
        assert drain_messages(channel, name, 1) == [b"hello"]

        # A poison message: requeued on every delivery until the limit dead-letters it.
        channel.basic_publish("", name, b"poison", PERSISTENT, mandatory=True)
        deliveries = 0
        for method, _properties, body in channel.consume(name, inactivity_timeout=5):
            if method is None:
                break
            assert body == b"poison"
            deliveries += 1
            channel.basic_nack(method.delivery_tag, requeue=True)
            if deliveries == 3:  # the first delivery and two redeliveries
                break
        channel.cancel()
        assert deliveries == 3
        assert drain_messages(channel, f"{name}.dead", 1) == [b"poison"]
        assert channel.queue_declare(name, passive=True).method.message_count == 0
    finally:
        channel.queue_delete(name)
        channel.queue_delete(f"{name}.dead")
        channel.exchange_delete(f"{name}.dlx")


def test_kill_then_start_keeps_persistent_message_of_durable_quorum_queue(
    rabbitmq_node: RabbitNode,
) -> None:
    """On the lent node (it is left running for the next test): SIGKILL and a graceful stop,
    each followed by a start on the same directory, port and URL, keep a persistent message
    of a durable quorum queue. ``cleanup()`` of a running node is checked by the demo's test
    (tests/test_demo_rabbitmq.py), whose node is booted for it anyway; here, of a node never
    started."""
    node = rabbitmq_node
    url, port, base = node.amqp_url, node.port, node.base
    params = pika.URLParameters(url)
    assert (params.host, params.port) == ("127.0.0.1", port)
    credentials = params.credentials
    assert isinstance(credentials, pika.PlainCredentials)
    assert credentials.username == node.user
    assert credentials.password
    assert credentials.password not in repr(node)
    assert node.evaluate("node()") == node.nodename  # erl_call reaches this node
    assert node.user in node.ctl("list_users")  # and so does rabbitmqctl
    keep = f"keep.{uuid.uuid4().hex[:12]}"
    conn = pika.BlockingConnection(node.connection_parameters())
    channel = _channel(conn)
    channel.queue_declare(keep, durable=True, arguments={"x-queue-type": "quorum"})
    channel.basic_publish("", keep, b"survivor", PERSISTENT, mandatory=True)
    beam = node.pid
    assert beam is not None
    # RabbitMQ 3.10 saves its registry of quorum queue members (ra's dets tables) every
    # 0.5 s, its members' metadata every 5 s: a node SIGKILLed before a save after a
    # declaration restarts that queue empty, under a new id, or with a member its leader
    # never answers for (waiting 1 s failed twice in whole-suite runs). The saves are made
    # now, with mnesia's log, instead of waited for.
    synced = node.evaluate("[mnesia:sync_log() | [dets:sync(T) || T <- dets:all()]]")
    assert len(synced) > 1
    assert set(synced) == {"ok"}, synced

    node.kill()
    assert not node.running
    assert node.pid is None
    assert _proc_state(beam) in {"gone", "Z"}
    assert not port_open(port)
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        conn.process_data_events(time_limit=1)
    assert conn.is_closed

    node.start()  # same directory, same port, same URL
    assert (node.amqp_url, node.port, node.base) == (url, port, base)
    method, body = _get_once_its_leader_answers(url, keep)  # not acked: requeued
    assert method is not None
    assert body == b"survivor"

    node.terminate()  # SIGTERM: a graceful shutdown
    node.stop()  # waits for it
    assert not node.running
    assert not port_open(port)
    node.start()
    conn = pika.BlockingConnection(pika.URLParameters(url))
    channel = _channel(conn)
    assert drain_messages(channel, keep, 1) == [b"survivor"]
    channel.queue_delete(keep)
    conn.close()


def _get_once_its_leader_answers(url: str, queue: str) -> tuple[Any, bytes | None]:
    """basic_get on a quorum queue of a node just restarted after SIGKILL: until the queue's
    leader is elected again the broker answers INTERNAL_ERROR (541, a timeout) and closes
    the connection (seen on a loaded machine); asked again on a new connection."""
    deadline = time.monotonic() + 30
    while True:
        conn = pika.BlockingConnection(pika.URLParameters(url))
        try:
            method, _properties, body = _channel(conn).basic_get(queue)
        except pika.exceptions.ConnectionClosedByBroker as exc:
            if exc.reply_code != 541 or time.monotonic() > deadline:
                raise
            continue
        finally:
            if conn.is_open:
                conn.close()
        return method, body


def test_cleanup_of_a_node_never_started_deletes_its_directory() -> None:
    require_rabbitmq(rabbitmq_available())
    node = create_rabbitmq_node()
    base = node.base
    assert (base / ".erlang.cookie").exists()
    node.cleanup()
    assert not base.exists()
    node.cleanup()  # again: nothing to do
    with pytest.raises(RuntimeError, match="cleaned up"):
        node.start()


def test_node_ports_are_picked_outside_the_ephemeral_range() -> None:
    """Outgoing connections take local ports from the kernel's ephemeral range, so a node's
    port there could be taken while it is down (even by a client reconnecting to it, which
    may connect to itself); the helpers pick ports outside it."""
    low, high = runlane.cli._rabbit_host.ephemeral_ports()
    for _ in range(50):
        port = runlane.cli._rabbit_host.free_port()
        assert not low <= port <= high, (port, low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))  # it was free


def test_a_node_whose_distribution_port_was_taken_starts_on_another(
    rabbitmq_node: RabbitNode,
) -> None:
    """The distribution port is picked free when the node is made; any process (another
    test's outgoing connection, say) may hold it by the next start. The node then starts on
    a fresh one, with the same AMQP port and URL (peers find the other through epmd)."""
    node = rabbitmq_node
    url, taken = node.amqp_url, node.dist_port
    node.stop()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("", taken))
        holder.listen()
        node.start()
        assert node.running
        assert node.dist_port != taken
        assert node.amqp_url == url
        conn = pika.BlockingConnection(pika.URLParameters(url))
        conn.close()


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"


def test_rabbitmq_available_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(runlane.cli._rabbit_host, "RABBITMQ_SERVER", tmp_path / "rabbitmq-server")
    reason = rabbitmq_available()
    assert reason is not None
    assert "\n" not in reason
    assert RABBITMQ_INSTALL_COMMAND in reason
    assert RABBITMQ_INSTALL_COMMAND == "apt-get install rabbitmq-server"


def test_missing_broker_skips_locally_and_fails_under_ci() -> None:
    reason = "RabbitMQ is not installed: apt-get install rabbitmq-server"
    assert rabbitmq_test_verdict(None, {"CI": "true"}) == ("run", "")
    assert rabbitmq_test_verdict(reason, {}) == ("skip", reason)
    assert rabbitmq_test_verdict(reason, {"CI": "false"}) == ("skip", reason)
    verdict, message = rabbitmq_test_verdict(reason, {"CI": "true"})
    assert verdict == "fail"
    assert reason in message

    require_rabbitmq(None, {"CI": "true"})  # available: the test runs
    with pytest.raises(pytest.skip.Exception, match="apt-get install rabbitmq-server"):
        require_rabbitmq(reason, {})
    with pytest.raises(pytest.fail.Exception, match="apt-get install rabbitmq-server"):
        require_rabbitmq(reason, {"CI": "true"})
