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

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from runlane import RunContext, Runlane, create_runlane, queue, task
from runlane._rabbit_nodes import RabbitNode
from runlane.models import RunStatus
from runlane.rabbitmq import RabbitMQStatus, rabbitmq_lane

pytestmark = pytest.mark.slow

HANDLER_SECONDS = 0.02  # long enough for runs to be in flight when the node dies
TRIGGER_EVERY = 0.02
OUTAGE_SECONDS = 4.0


def _leader(node: RabbitNode, name: str) -> str | None:
    rows: list[dict[str, Any]] = json.loads(
        node.ctl("list_queues", "name", "leader", "--formatter", "json")
    )
    return next((row["leader"] for row in rows if row["name"] == name), None)


def _online(node: RabbitNode, name: str) -> list[str]:
    rows: list[dict[str, Any]] = json.loads(
        node.ctl("list_queues", "name", "online", "--formatter", "json")
    )
    return next((list(row["online"]) for row in rows if row["name"] == name), [])


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

    @task(id="cluster.work", queue=work.name)
    def handler(payload: Any, context: RunContext) -> int:
        with lock:
            executions[context.run_id] += 1
        time.sleep(HANDLER_SECONDS)
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
        name = f"runlane.{schema}.default.{work.name}"
        deadline = time.monotonic() + 30
        while _leader(producer_node, name) is None:
            assert time.monotonic() < deadline, "the first worker never declared its queue"
            time.sleep(0.2)
        assert _leader(producer_node, name) == leader_node.nodename
        assert set(_online(producer_node, name)) == {n.nodename for n in cluster}
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
            time.sleep(2.0)  # runs flow through both workers (and the member registry is saved)
            assert executions, "no run started before the kill"
            leader_node.kill()  # SIGKILL: the leader's VM and every helper process
            outage.set()
            killed_at = time.monotonic()
            while time.monotonic() - killed_at < OUTAGE_SECONDS:
                producer.run_maintenance_once()
                time.sleep(0.5)
            # a new leader among the survivors
            assert _leader(producer_node, name) in {producer_node.nodename, other_node.nodename}
            outage.clear()
            restart = leader_node.start()
            time.sleep(1.0)
        finally:
            stop.set()
            triggering.join(30)
        assert not errors, errors

        deadline = time.monotonic() + 45
        while True:
            producer.run_maintenance_once()
            row = db.execute(
                sql.SQL("select count(*) from {}.runs where status = 'completed'").format(
                    sql.Identifier(schema)
                )
            ).fetchone()
            completed = 0 if row is None else int(row[0])
            if completed >= len(triggered):
                break
            assert time.monotonic() < deadline, (
                f"{completed} of {len(triggered)} runs completed; status: {producer.status()}"
            )
            time.sleep(0.3)
        worker_1.close(timeout=10)
        worker_2.close(timeout=10)

        assert len(during_outage) >= 50  # the outage was not trivially short
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
        assert leader_node.nodename in _online(producer_node, name)
        elapsed = time.monotonic() - began
        print(
            f"\n{len(triggered)} runs ({len(during_outage)} during the outage), each executed "
            f"once; node restart {restart:.1f}s; test {elapsed:.1f}s"
        )
    finally:
        for runtime_ in (first, second, producer):
            runtime_.close()
