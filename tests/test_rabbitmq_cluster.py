"""Past one machine: the RabbitMQ lane on a three-node cluster keeps completing runs, each
handler once, while the node leading the quorum queue is SIGKILLed mid-run.

pika's ``URLParameters`` names one host, and the lane takes one ``amqp_url``: a worker whose
node dies retries that node until it is back. So the producer and the two workers each get a
different node; the node the first worker declared the queue through (its leader) is killed,
the runs triggered while it is down still complete through the surviving members (the other
worker consumes, the producer publishes with confirms), and the killed node is started again
after a few seconds so its worker reconnects.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pika  # type: ignore[import-untyped, unused-ignore]
import psycopg
import pytest
from psycopg import sql

from runlane import RunContext, Runlane, create_runlane, queue, task
from runlane.cli._rabbit_nodes import RabbitNode
from runlane.models import RunStatus
from runlane.rabbitmq import RabbitMQStatus, rabbitmq_lane
from tests.helpers import consumer_ready, drain_messages, poll, wait_until

pytestmark = pytest.mark.slow

TRIGGER_EVERY = 0.02
OUTAGE_RUNS = 150  # triggered while the leader is down


PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _channel(connection: Any) -> Any:
    channel = connection.channel()
    channel.confirm_delivery()  # basic_publish raises unless the broker confirms
    return channel


def _members(node: RabbitNode, name: str) -> tuple[str | None, list[str]]:
    """The queue's leader and its online members, as ``node`` sees them (what
    ``rabbitmqctl list_queues name leader online`` lists, asked through ``erl_call``: a
    rabbitmqctl call starts an Erlang VM, about 0.7 CPU-seconds)."""
    found = node.queue_members(name)
    return (None, []) if found is None else (found["leader"], list(found["online"]))


@pytest.fixture
def cluster(rabbitmq_cluster: list[RabbitNode]) -> Iterator[list[RabbitNode]]:
    yield rabbitmq_cluster
    for node in rabbitmq_cluster:  # the module's cluster is whole again for the next test
        if not node.running:
            node.start()


def test_runs_complete_once_each_while_the_queue_leader_is_sigkilled(
    cluster: list[RabbitNode], database_url: str, schema: str, db: psycopg.Connection[Any]
) -> None:
    began = time.monotonic()
    producer_node, leader_node, other_node = cluster
    # a queue name of this test's own on the shared module cluster
    work = queue(f"work_{uuid.uuid4().hex[:8]}", default=True)
    executions: Counter[uuid.UUID] = Counter()
    lock = threading.Lock()
    flowing, killed = threading.Event(), threading.Event()
    held = [0]

    @task(id="cluster.work", queue=work.name)
    def handler(payload: Any, context: RunContext) -> int:
        with lock:
            executions[context.run_id] += 1
            hold = flowing.is_set() and not killed.is_set()
            held[0] += hold
        if hold:  # in flight when the leader dies: every slot of both workers
            killed.wait(30)
        return int(payload)

    def runtime(node: RabbitNode) -> Runlane:
        lane = rabbitmq_lane(
            connection_string=database_url,
            schema=schema,
            amqp_url=node.amqp_url,
            connect_timeout=5.0,
            publish_timeout=timedelta(seconds=5),
            claim_duration=timedelta(seconds=15),
            recovery_threshold=timedelta(seconds=30),
        )
        return create_runlane(lane=lane, queues=[work], tasks=[handler])

    producer, first, second = runtime(producer_node), runtime(leader_node), runtime(other_node)
    triggered: list[uuid.UUID] = []
    during_outage: list[uuid.UUID] = []
    try:
        # the first worker declares the queue through its node: that member leads it
        worker_1 = first.create_delivery_worker(concurrency=4)
        consumer_ready(worker_1, timeout=30)  # it consumes: its queue is declared
        name = f"runlane.{schema}.default.{work.name}"
        leader, online = _members(producer_node, name)
        assert leader == leader_node.nodename
        assert set(online) == {n.nodename for n in cluster}
        worker_2 = second.create_delivery_worker(concurrency=4)

        stop = threading.Event()
        outage = threading.Event()
        errors: list[BaseException] = []

        def trigger_loop() -> None:
            n = 0
            try:
                while not stop.is_set():
                    run_id = producer.trigger(handler, n).id
                    triggered.append(run_id)
                    if outage.is_set():
                        during_outage.append(run_id)
                    n += 1
                    stop.wait(TRIGGER_EVERY)
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)

        triggering = threading.Thread(target=trigger_loop, name="cluster-producer")
        triggering.start()
        try:
            # runs flow through both workers
            wait_until(
                lambda: worker_1.runs_executed > 0 and worker_2.runs_executed > 0,
                timeout=30,
                what="runs through both workers",
            )
            assert executions, "no run started before the kill"
            flowing.set()
            wait_until(lambda: held[0] >= 8, timeout=15, what="both workers' 8 slots in flight")
            # RabbitMQ saves its member registry every 0.5 s (a member killed before a save
            # after the declaration loses the queue): saved now instead of waited for
            synced = leader_node.evaluate("[mnesia:sync_log() | [dets:sync(T) || T <- dets:all()]]")
            assert set(synced) == {"ok"}, synced
            leader_node.kill()  # SIGKILL: the leader's VM and every helper process
            killed.set()
            outage.set()

            def outage_done() -> bool:
                producer.run_maintenance_once()
                return len(during_outage) >= OUTAGE_RUNS

            # the outage lasts until that many runs were triggered during it (not trivially
            # short), maintenance passing meanwhile
            wait_until(outage_done, timeout=60, interval=0.5, what="runs during the outage")
            # a new leader among the survivors
            leader, _ = _members(producer_node, name)
            assert leader in {producer_node.nodename, other_node.nodename}
            outage.clear()
            restart = leader_node.start()
            # triggers go on until the restarted member is back among the queue's members
            wait_until(
                lambda: leader_node.nodename in _members(producer_node, name)[1],
                timeout=30,
                interval=0.2,
                what="the restarted member online",
            )
        finally:
            stop.set()
            triggering.join(30)
        assert not errors, errors

        completed = 0

        def all_completed() -> bool:
            nonlocal completed
            producer.run_maintenance_once()
            row = db.execute(
                sql.SQL("select count(*) from {}.runs where status = 'completed'").format(
                    sql.Identifier(schema)
                )
            ).fetchone()
            completed = 0 if row is None else int(row[0])
            return completed >= len(triggered)

        assert poll(all_completed, timeout=45, interval=0.3), (
            f"{completed} of {len(triggered)} runs completed; status: {producer.status()}"
        )
        worker_1.close(timeout=10)
        worker_2.close(timeout=10)

        for run_id in triggered:
            assert producer.get_run(run_id).status is RunStatus.COMPLETED
        assert set(executions) == set(triggered)
        twice = {run_id: n for run_id, n in executions.items() if n != 1}
        assert not twice, f"handlers executed more than once: {twice}"
        report = producer.status()
        assert report.outbox_pending == 0
        broker = RabbitMQStatus.of(report).broker
        assert broker is not None
        assert broker.startswith("reachable")
        assert leader_node.nodename in _members(producer_node, name)[1]
        elapsed = time.monotonic() - began
        print(
            f"\n{len(triggered)} runs ({len(during_outage)} during the outage), each executed "
            f"once; node restart {restart:.1f}s; test {elapsed:.1f}s"
        )
    finally:
        for runtime_ in (first, second, producer):
            runtime_.close()


def test_quorum_queue_survives_sigkill_of_a_cluster_node(
    cluster: list[RabbitNode],
) -> None:
    """The cluster fixture itself: three members, a quorum queue on all of them that keeps
    confirming and delivering while one member is SIGKILLed, and the member back online
    after its restart."""
    first, second, third = cluster
    assert len({first.port, second.port, third.port}) == 3
    assert set(first.running_nodes()) == {node.nodename for node in cluster}

    conn = pika.BlockingConnection(first.connection_parameters())
    channel = _channel(conn)
    name = f"t.{uuid.uuid4().hex[:12]}"
    channel.queue_declare(name, durable=True, arguments={"x-queue-type": "quorum"})
    found = first.queue_members(name)
    assert found is not None
    assert set(found["members"]) == {node.nodename for node in cluster}
    channel.basic_publish("", name, b"before", PERSISTENT, mandatory=True)

    second.kill()
    try:
        for i in range(20):  # confirmed by the two remaining members
            channel.basic_publish("", name, f"after {i}".encode(), PERSISTENT, mandatory=True)
        expected = [b"before"] + [f"after {i}".encode() for i in range(20)]
        assert drain_messages(channel, name, len(expected)) == expected
    finally:
        second.start()  # rejoins the cluster from its own data directory
    assert second.nodename in _members(first, name)[1]
    channel.queue_delete(name)
    conn.close()
