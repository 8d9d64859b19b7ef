"""A RabbitMQ lane's acquirer driven directly, as a worker's acquiring slot drives it, on a
runtime of the test's schema: tests of what the acquirer does with its deliveries."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from runlane import RunContext, Runlane, queue, task
from runlane.lanes import AcquirerOptions
from runlane.rabbitmq._consumer import RabbitAcquirer
from tests.conftest import RabbitRuntimes

__all__ = ["driven_acquirer", "round_trip"]


@contextmanager
def driven_acquirer(
    rabbit_runtime: RabbitRuntimes,
    rabbitmq_url: str,
    name: str,
    *,
    concurrency: int,
    claim_batch: int,
    runs: int,
) -> Iterator[tuple[RabbitAcquirer, Runlane]]:
    """A started acquirer named ``{name}-acquirer`` of the default queue, consuming, with
    ``runs`` runs of ``{name}.noop`` triggered to it; closed afterwards."""

    @task(id=f"{name}.noop")
    def noop(payload: Any, context: RunContext) -> Any:
        return payload

    runlane = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[noop])
    runlane.start()
    made = runlane.lane.create_acquirer(
        runlane._life.storage,
        AcquirerOptions(
            environment=runlane.environment,
            queues=[queue("default")],
            name=f"{name}-acquirer",
            lease=timedelta(seconds=60),
            drain=False,
            concurrency=concurrency,
            claim_batch=claim_batch,
        ),
        lambda run_id: None,
    )
    assert isinstance(made, RabbitAcquirer)
    made.start()
    try:
        assert made.consuming.wait(15), "the consumer consuming"
        runlane.trigger_many(noop, list(range(runs)))
        yield made, runlane
    finally:
        made.close(10)


def round_trip(acquirer: RabbitAcquirer) -> None:
    """A synchronous call on the consumer's channel, on its thread: acknowledgements queued
    before it have been sent, and deliveries the broker sent before answering it have
    reached the buffer."""
    conn, channel = acquirer._conn, acquirer._channel
    assert conn is not None
    assert channel is not None
    done = threading.Event()

    def call() -> None:
        try:
            channel.basic_qos(prefetch_count=acquirer._prefetch)
        finally:
            done.set()

    conn.add_callback_threadsafe(call)
    assert done.wait(10), "the consumer thread did not run the call"
