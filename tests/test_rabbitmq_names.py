"""Broker queue names of the RabbitMQ lane: distinct (schema, environment, queue) triples
never share a broker queue, and a name longer than AMQP's 255 bytes is refused when the
runtime is built (or, written by a producer that never checked it, set aside by the
publisher with that reason) instead of failing on the broker forever.

Tests share the session broker (``rabbitmq_url``; queue names carry the test's schema)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runlane import (
    ConfigurationError,
    RunContext,
    Runlane,
    RunStatus,
    create_runlane,
    queue,
    task,
)
from runlane.rabbitmq import rabbitmq_lane
from runlane.rabbitmq._amqp import MAX_QUEUE_NAME_BYTES, queue_name
from tests.conftest import RabbitRuntimes, RunlaneFactory
from tests.helpers import Conn, consumer_ready, q, wait_until

RabbitEnvs = Callable[..., Runlane]


@pytest.fixture
def rabbit_env(rabbit_runtime: RabbitRuntimes, rabbitmq_url: str) -> RabbitEnvs:
    """Runtimes on the RabbitMQ lane, this test's schema and the session broker, in the
    ``environment`` given; closed at teardown."""
    return functools.partial(rabbit_runtime, amqp_url=rabbitmq_url)


@task(id="names.echo")
def echo(payload: Any, context: RunContext) -> Any:
    return payload


_QUEUE_50 = "q" * 50


def _env_for_length(schema: str, queue_name_: str, total: int) -> str:
    """An environment name making ``runlane.<schema>.<env>.<queue>`` exactly ``total`` bytes."""
    rest = len(f"runlane.{schema}..{queue_name_}")
    return "e" * (total - rest)


# -- the mapping -----------------------------------------------------------------------------

# the characters that matter to the encoding, and a few that do not
_parts = st.text(alphabet="ab.%2E5", min_size=1, max_size=8)


def _unescape(part: str) -> str:
    return part.replace("%2E", ".").replace("%25", "%")


@given(_parts, _parts, _parts)
def test_a_broker_queue_name_gives_back_its_schema_environment_and_queue(
    schema: str, environment: str, name: str
) -> None:
    """Decodable, hence injective (distinct triples never share a broker queue): the first
    three dots end the prefix, the schema and the environment; the rest is the queue."""
    prefix, s, e, rest = queue_name(schema, environment, name).split(".", 3)
    assert prefix == "runlane"
    assert (_unescape(s), _unescape(e), rest) == (schema, environment, name)
    assert queue_name(schema, environment, name) != f"runlane.{schema}.dead"


def test_names_without_a_dot_or_percent_in_schema_and_environment_keep_their_broker_queue() -> None:
    # existing deployments: the broker queues they declared before the escaping are the same
    assert queue_name("runlane", "default", "default") == "runlane.runlane.default.default"
    name = queue_name("app_1", "prod-eu:2/x", "emails.high")
    assert name == "runlane.app_1.prod-eu:2/x.emails.high"
    # the pair
    assert queue_name("s", "a", "b.c") == "runlane.s.a.b.c"
    assert queue_name("s", "a.b", "c") == "runlane.s.a%2Eb.c"


# -- colliding environments on a real broker ----------------------------------------------------


def test_environment_a_with_queue_b_c_and_environment_a_b_with_queue_c_both_complete(
    rabbit_env: RabbitEnvs,
) -> None:
    """Before the escaping both mapped to ``runlane.<schema>.a.b.c``: each environment's
    consumer took the other's messages, found no such run, acknowledged and dropped them,
    and about half the runs stayed queued."""
    first = rabbit_env(environment="a", queues=[queue("b.c", default=True)], tasks=[echo])
    second = rabbit_env(environment="a.b", queues=[queue("c", default=True)], tasks=[echo])
    workers = [rl.create_delivery_worker(concurrency=2) for rl in (first, second)]
    for worker in workers:
        consumer_ready(worker)
    runs = [(rl, rl.trigger(echo, n).id) for n in range(10) for rl in (first, second)]
    for rl, run_id in runs:
        snapshot = rl.wait_for_run(run_id, timeout=20)
        assert snapshot.status is RunStatus.COMPLETED, snapshot
    for worker in workers:
        stats = worker.acquirer.stats  # type: ignore[attr-defined]
        assert stats.unknown == 0, "a consumer received the other environment's messages"


# -- the 255-byte limit --------------------------------------------------------------------------


def test_a_name_over_255_bytes_is_refused_when_the_runtime_is_built(
    database_url: str, schema: str, rabbitmq_url: str, db: Conn
) -> None:
    lane = rabbitmq_lane(connection_string=database_url, schema=schema, amqp_url=rabbitmq_url)
    environment, long_queue = "e" * 200, "q" * 200
    size = len(f"runlane.{schema}.{environment}.{long_queue}")
    with pytest.raises(ConfigurationError) as caught:
        create_runlane(lane=lane, environment=environment, queues=[queue(long_queue)])
    message = str(caught.value)
    assert f"{size} bytes" in message
    assert f"limit of {MAX_QUEUE_NAME_BYTES}" in message
    assert "shorter environment or queue name" in message
    assert environment not in message  # described, not repeated
    assert long_queue not in message
    assert "200 characters" in message

    # one byte over counts, escapes included
    over = _env_for_length(schema, _QUEUE_50, MAX_QUEUE_NAME_BYTES + 1)
    with pytest.raises(ConfigurationError, match=f"{MAX_QUEUE_NAME_BYTES + 1} bytes"):
        create_runlane(lane=lane, environment=over, queues=[queue(_QUEUE_50, default=True)])
    dotted = "a." + _env_for_length(schema, _QUEUE_50, MAX_QUEUE_NAME_BYTES)[2:]
    with pytest.raises(ConfigurationError, match=f"{MAX_QUEUE_NAME_BYTES + 2} bytes"):
        # '.' is written %2E: 2 bytes more
        create_runlane(lane=lane, environment=dotted, queues=[queue(_QUEUE_50, default=True)])
    # nothing was written
    row = db.execute(
        q("select (select count(*) from {s}.runs) + (select count(*) from {s}.outbox)", schema)
    ).fetchone()
    assert row == (0,)


def test_a_name_of_exactly_255_bytes_works_on_the_broker(
    rabbit_env: RabbitEnvs, schema: str
) -> None:
    environment = _env_for_length(schema, _QUEUE_50, MAX_QUEUE_NAME_BYTES)
    assert len(queue_name(schema, environment, _QUEUE_50)) == MAX_QUEUE_NAME_BYTES
    rl = rabbit_env(environment=environment, queues=[queue(_QUEUE_50, default=True)], tasks=[echo])
    consumer_ready(rl.create_delivery_worker(concurrency=1))
    run_id = rl.trigger(echo, "at the limit").id
    assert rl.wait_for_run(run_id, timeout=20).status is RunStatus.COMPLETED


def test_a_trigger_naming_an_unregistered_queue_is_refused_before_anything_is_written(
    rabbit_env: RabbitEnvs, schema: str, db: Conn
) -> None:
    """A queue cannot first appear at trigger time: only registered queues, each checked
    when the runtime was built, reach the broker."""
    rl = rabbit_env(environment="e" * 60, tasks=[echo])
    long_queue = "z" * 200
    with pytest.raises(ConfigurationError, match="is not registered"):
        rl.trigger(echo, 1, queue=long_queue)
    with pytest.raises(ConfigurationError, match="is not registered"):
        rl.trigger_many(echo, [1, 2], queue=long_queue)
    row = db.execute(
        q("select (select count(*) from {s}.runs) + (select count(*) from {s}.outbox)", schema)
    ).fetchone()
    assert row == (0,)


def test_an_item_with_a_name_too_long_is_set_aside_with_the_reason_and_the_rest_published(
    rabbit_env: RabbitEnvs, make_runlane: RunlaneFactory, schema: str, db: Conn
) -> None:
    """A producer that never checked the name (here a polling-lane runtime of the same
    environment, as an older runlane would be) writes an outbox item the broker cannot take:
    the publisher keeps the reason as the item's error instead of blaming the broker, and
    goes on publishing the other items."""
    environment = "e" * 60
    rl = rabbit_env(environment=environment, tasks=[echo])
    worker = rl.create_delivery_worker(concurrency=1)
    consumer_ready(worker)
    rl.wait_for_run(rl.trigger(echo, "warm-up").id, timeout=20)  # outbox on, publisher up

    long_queue = "z" * 200
    unchecked = make_runlane(environment=environment, queues=[queue(long_queue)], tasks=[echo])
    stuck = unchecked.trigger(echo, "too long", queue=long_queue).id

    def item_error() -> str | None:
        row = db.execute(
            q("select last_error from {s}.outbox where run_id = %s", schema), (stuck,)
        ).fetchone()
        return None if row is None else row[0]

    wait_until(lambda: item_error() is not None, timeout=15, what="the item's error")
    error = item_error()
    assert error is not None
    assert f"limit of {MAX_QUEUE_NAME_BYTES}" in error, error
    assert "unreachable" not in error, error
    assert "ShortStringTooLong" not in error, error
    after = rl.trigger(echo, "after").id
    assert rl.wait_for_run(after, timeout=20).status is RunStatus.COMPLETED
    assert rl.get_run(stuck).status is RunStatus.QUEUED
