"""The RabbitMQ consumer's prefetch: one claim batch while its worker claims for free slots,
``_AHEAD_BATCHES`` (six) while it claims ahead of them (quick handlers and a backlog), and
back to one once it stops, without losing, repeating or stranding a delivery. The acquirer
is driven directly, as a worker's acquiring slot drives it, so that what it is asked for
is exact."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from runlane import RunContext, task
from runlane.rabbitmq import _consumer
from runlane.rabbitmq._consumer import RabbitAcquirer
from tests._acquirers import driven_acquirer, round_trip
from tests.conftest import RabbitRuntimes
from tests.helpers import amqp_queue, ready_messages, wait_until

RUNS = 80
CONCURRENCY = 2
CLAIM_BATCH = 8  # one claim batch: the prefetch of its slots
AHEAD = _consumer._AHEAD_BATCHES * CLAIM_BATCH  # the prefetch while it claims ahead: 48


@pytest.fixture
def acquirer(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[RabbitAcquirer, Any]]:
    monkeypatch.setattr(_consumer, "_AHEAD_SECONDS", 0.3)
    with driven_acquirer(
        rabbit_runtime,
        rabbitmq_url,
        "prefetch",
        concurrency=CONCURRENCY,
        claim_batch=CLAIM_BATCH,
        runs=RUNS,
    ) as driven:
        yield driven


def test_the_prefetch_grows_only_while_the_worker_claims_ahead(
    acquirer: tuple[RabbitAcquirer, Any], rabbitmq_url: str, schema: str
) -> None:
    consumer, _ = acquirer

    def buffered() -> int:
        return len(consumer._buffer)

    wait_until(lambda: buffered() == CLAIM_BATCH, timeout=15, what="one claim batch buffered")
    round_trip(consumer)
    assert buffered() == CLAIM_BATCH  # claims for free slots only: one batch, no more

    claimed = {run.id for run in consumer.acquire(CONCURRENCY, 0)}  # free slots only
    wait_until(lambda: buffered() == CLAIM_BATCH, timeout=15, what="the batch refilled")
    round_trip(consumer)
    assert buffered() == CLAIM_BATCH
    assert not consumer._ahead_tags

    # asking for more than its slots: the worker claims ahead, and the consumer with it
    claimed |= {run.id for run in consumer.acquire(CONCURRENCY + 2, 0)}
    assert len(claimed) == 2 * CONCURRENCY + 2

    def still_ahead() -> int:
        # the worker goes on claiming ahead while the batches arrive (each such claim keeps
        # the ahead consumer for _AHEAD_SECONDS more): on a loaded machine delivering 40
        # messages can take longer than the 0.3 s this test gives one claim
        consumer._pace(CONCURRENCY + 2)
        return buffered()

    wait_until(lambda: still_ahead() == AHEAD, timeout=15, what="six claim batches buffered")
    still_ahead()
    round_trip(consumer)
    assert buffered() == AHEAD

    # it stops asking for more than its slots: the second consumer goes, what it delivered
    # stays buffered and is claimed as any other delivery
    wait_until(lambda: not consumer._ahead_tags, timeout=15, what="the ahead consumer gone")
    back_to_one = False  # the buffer is down to one claim batch: only the first consumer
    while len(claimed) < RUNS:
        taken = {run.id for run in consumer.acquire(CONCURRENCY, 0)}
        assert not taken & claimed, "a run was claimed twice"
        claimed |= taken
        if not taken:
            wait_until(lambda: buffered() > 0, timeout=15, what="a delivery")
        round_trip(consumer)  # the broker has sent what the acknowledgements allow
        if buffered() <= CLAIM_BATCH:
            back_to_one = True
        assert not back_to_one or buffered() <= CLAIM_BATCH, "more than one batch again"
    assert back_to_one

    def settled() -> bool:
        # acks go out after the claims' WAL flush, from the acks thread: each look first lets
        # the consumer thread run what that thread has queued
        round_trip(consumer)
        return not consumer._unsettled

    wait_until(settled, timeout=15, what="every delivery acknowledged")
    assert consumer.stats.claimed == RUNS
    assert consumer.stats.duplicates == consumer.stats.unknown == 0
    assert consumer.stats.connections == 1  # cancelling its own consumer is no broker cancel
    assert buffered() == 0
    assert ready_messages(rabbitmq_url, amqp_queue(schema)) == 0


def test_a_worker_busy_with_long_handlers_keeps_one_claim_batch(
    rabbit_runtime: RabbitRuntimes, rabbitmq_url: str
) -> None:
    """Slots held by long handlers ask only for free slots: no second consumer, and no
    more than one claim batch waits in the buffer while another worker could take it."""
    release = threading.Event()
    started: list[int] = []

    @task(id="prefetch.long")
    def long(payload: int, context: RunContext) -> int:
        started.append(payload)
        release.wait(30)
        return payload

    runlane = rabbit_runtime(amqp_url=rabbitmq_url, tasks=[long])
    worker = runlane.create_delivery_worker(concurrency=CONCURRENCY, claim_batch=CLAIM_BATCH)
    try:
        consumer = worker.acquirer
        assert isinstance(consumer, RabbitAcquirer)
        assert consumer.consuming.wait(15), "the consumer consuming"
        runlane.trigger_many(long, list(range(RUNS)))
        wait_until(lambda: len(started) == CONCURRENCY, timeout=15, what="both slots busy")
        wait_until(
            lambda: len(consumer._buffer) == CLAIM_BATCH, timeout=15, what="a batch buffered"
        )
        round_trip(consumer)
        assert len(consumer._buffer) == CLAIM_BATCH
        assert not consumer._ahead_tags
        assert len(started) == CONCURRENCY
    finally:
        release.set()
        worker.close(timeout=10)
