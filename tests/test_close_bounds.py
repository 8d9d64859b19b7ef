"""Every ``close(timeout)`` keeps its bound overall, whatever stalls behind it.

Before: the RabbitMQ consumer's close gave its Postgres listener and its consumer thread the
full timeout each, and its watchdog two seconds more; the runtime's close handed the
RabbitMQ publisher a fixed ten seconds whatever its own timeout. A broker and a database
that accept connections but never answer (a paused node, a stalled network path) made
``close(timeout=1)`` take several times that. Now one deadline is shared by every wait of a
close. The stalls are real: TCP proxies in front of the real broker and the real database
that stop forwarding.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from psycopg.conninfo import conninfo_to_dict

from runlane import RunContext, create_runlane, task
from runlane.postgres import postgres_polling_lane
from runlane.rabbitmq import rabbitmq_lane
from runlane.rabbitmq._consumer import RabbitAcquirer
from runlane.testing import run_until_idle
from tests._proxy import TcpProxy, tcp_proxy
from tests.conftest import RunlaneFactory
from tests.helpers import consumer_ready, wait_until

# what a close may take past its timeout: joins and socket shutdowns after the deadline,
# and the lifecycle writer's short grace for a statement cancelled at the deadline
ALLOWANCE = 1.5


@task(id="noop")
def noop(payload: None, context: RunContext) -> None:
    pass


@pytest.fixture
def amqp_proxy(rabbitmq_url: str) -> Iterator[tuple[TcpProxy, str]]:
    """A proxy in front of the broker, and the AMQP URL through it."""
    params = conninfo_to_dict(rabbitmq_url.replace("amqp://", "postgresql://"))
    proxy = TcpProxy(str(params["host"]), int(str(params["port"])))
    proxy.up()
    try:
        yield proxy, rabbitmq_url.replace(f":{params['port']}/", f":{proxy.port}/")
    finally:
        proxy.close()


def _threads_of(prefix: str) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(prefix))


def _no_threads_of(prefix: str) -> None:
    wait_until(
        lambda: not _threads_of(prefix),
        timeout=10,
        what=f"the threads of {prefix} to end",
        state=lambda: _threads_of(prefix),
    )


def test_a_rabbitmq_worker_closes_in_time_when_broker_and_database_stall(
    amqp_proxy: tuple[TcpProxy, str], database_url: str, schema: str
) -> None:
    """The broker stalls while the worker consumes and the database stalls under its
    listener and writer: ``close(timeout=2)`` returns within its bound, and once the
    stalled calls give up no thread of the worker is left."""
    broker, amqp_url = amqp_proxy
    with tcp_proxy(database_url) as pg:
        pg.up()
        rl = create_runlane(
            lane=rabbitmq_lane(
                connection_string=pg.url_for(database_url),
                schema=schema,
                amqp_url=amqp_url,
                connect_timeout=3.0,
            ),
            tasks=[noop],
        )
        try:
            worker = rl.create_delivery_worker(concurrency=1)
            consumer_ready(worker)
            acquirer = worker.acquirer
            assert isinstance(acquirer, RabbitAcquirer)
            # every connection from now on hangs: the live ones, and the ones made again
            broker.stall()
            pg.stall()
            pg.down()  # the listener and the writer reconnect, into the stall
            pg.up()
            wait_until(
                lambda: not acquirer.listener.connected.is_set(),
                timeout=10,
                what="the listener to lose its connection",
            )
            began = time.monotonic()
            worker.close(timeout=2)
            took = time.monotonic() - began
            assert took < 2 + ALLOWANCE, f"worker.close(timeout=2) took {took:.2f}s"
            assert worker.closed
            pg.unstall()
            broker.unstall()
            _no_threads_of(f"{worker.name}-")
        finally:
            pg.unstall()
            rl.close(timeout=10)
    _no_threads_of("runlane-")


def test_a_rabbitmq_runtime_closes_in_time_when_the_broker_stalls(
    amqp_proxy: tuple[TcpProxy, str], database_url: str, schema: str
) -> None:
    """A runtime whose publisher has eager triggers to publish to a broker that never
    answers: ``close(timeout=1)`` keeps its bound (it handed the publisher ten seconds of
    its own before) and leaves no thread once the broker's calls are cut off."""
    broker, amqp_url = amqp_proxy
    rl = create_runlane(
        lane=rabbitmq_lane(
            connection_string=database_url,
            schema=schema,
            amqp_url=amqp_url,
            publish_timeout=timedelta(seconds=5),
        ),
        tasks=[noop],
    )
    try:
        rl.trigger(noop, None)  # connects the publisher
        broker.stall()
        for _ in range(3):
            rl.trigger(noop, None)
        began = time.monotonic()
        rl.close(timeout=1)
        took = time.monotonic() - began
        assert took < 1 + ALLOWANCE, f"runtime.close(timeout=1) took {took:.2f}s"
    finally:
        broker.unstall()
        rl.close(timeout=10)
    _no_threads_of("runlane-")


def test_run_until_idle_leaves_no_timer_thread(make_runlane: RunlaneFactory) -> None:
    """run_until_idle's timeout timer is named and joined: nothing of it is left after the
    call (it was an unnamed thread, cancelled and never joined)."""
    rl = make_runlane(tasks=[noop])
    rl.trigger(noop, None)
    before = set(threading.enumerate())
    assert run_until_idle(rl, timeout=30).runs_executed == 1
    assert _threads_of("runlane-run-until-idle-timer") == []
    unnamed = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("Thread-")]
    assert unnamed == []


def test_a_polling_runtime_closes_in_time_when_the_database_stalls(
    database_url: str, schema: str
) -> None:
    """A runtime with a worker and maintenance services whose database stops answering
    (live connections and new ones): ``close(timeout=2)`` keeps its bound (timeout=1 took 3 s:
    the pool's close waited up to 5 s for its threads whatever the timeout)."""
    with tcp_proxy(database_url) as pg:
        pg.up()
        rl = create_runlane(
            lane=postgres_polling_lane(
                connection_string=pg.url_for(database_url), schema=schema, connect_timeout=3.0
            ),
            tasks=[noop],
        )
        try:
            rl.trigger(noop, None)
            worker = rl.create_delivery_worker(concurrency=2)
            services = rl.start_services()
            assert worker.idle_signal.wait(10)
            pg.stall()
            pg.down()  # every connection is made again, into the stall
            pg.up()
            began = time.monotonic()
            rl.close(timeout=2)
            took = time.monotonic() - began
            assert took < 2 + ALLOWANCE, f"runtime.close(timeout=2) took {took:.2f}s"
            assert worker.closed
            assert services.closed
        finally:
            pg.unstall()
            rl.close(timeout=10)
    _no_threads_of("runlane-")
