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

import psycopg_pool
import pytest
from psycopg.conninfo import conninfo_to_dict

from runlane import RunContext, StorageUnavailable, create_runlane, task
from runlane.postgres import PostgresStorage, postgres_polling_lane
from runlane.postgres._connections import PoolSource
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
    database_url: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A runtime with a worker and maintenance services whose database stops answering
    (live connections and new ones): ``close(timeout=2)`` keeps its bound (timeout=1 took 3 s:
    the pool's close waited up to 5 s for its threads whatever the timeout; on a loaded
    machine 3.5 to 12 s: graces added one after the other, a cancel request waiting out the
    connect timeout, the close waiting behind a pool being rebuilt). The threads it gave up
    on end without reporting what they met afterwards (their connections closed under them)
    as failures: the writer logged a traceback, each band a failed release."""
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
    after_close = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("runlane") and (r.exc_info or "RunlaneClosed(" in r.getMessage())
    ]
    assert after_close == []


def test_interrupt_ends_a_statement_the_stalled_database_never_answers(
    database_url: str, schema: str
) -> None:
    """A worker's close interrupts the statements still in flight at its deadline (the
    writer's, an aborted claim's). Against a database that stopped answering, the cancel
    request waited out its own timeout (up to 3 s, connect_timeout) and the statement stayed
    blocked after it. Now the cancel gets a quarter second, then the socket is shut down
    under the call, which fails at once and is not repeated on a new connection (a
    reconnect into the stall would wait out the connect timeout)."""
    with tcp_proxy(database_url) as pg:
        pg.up()
        storage = PostgresStorage(
            connection_string=pg.url_for(database_url), schema=schema, connect_timeout=3.0
        )
        view = storage.dedicated("runlane-test-view")
        try:
            view.database_now()  # connected, the schema checked
            pg.stall()
            failures: list[BaseException] = []
            ended = threading.Event()

            def call() -> None:
                try:
                    view.database_now()
                except BaseException as exc:
                    failures.append(exc)
                finally:
                    ended.set()

            blocked = threading.Thread(target=call, name="runlane-test-blocked")
            blocked.start()
            wait_until(lambda: pg.unanswered() >= 1, timeout=10, what="the statement to be sent")
            began = time.monotonic()
            view.interrupt()
            took = time.monotonic() - began
            assert took < 1.0, f"interrupt() took {took:.2f}s"
            assert ended.wait(1.0), "the interrupted statement is still blocked"
            assert len(failures) == 1
            assert isinstance(failures[0], StorageUnavailable), repr(failures[0])
            assert "interrupted" in str(failures[0])
            blocked.join(1)
        finally:
            pg.unstall()
            view.close()
            storage.close(timeout=10)


def test_a_pool_closes_in_time_while_another_thread_builds_it_again(database_url: str) -> None:
    """A maintenance band that rebuilt the runtime's pool (the old one thrown away after the
    database stopped answering) held the pool's lock through the new pool's first connect
    (connect_timeout 3 s): the runtime's close waited behind it, 6 s for close(timeout=2)
    on a loaded machine. Now close does not wait for a build; the builder closes what it
    built and raises PoolClosed."""
    with tcp_proxy(database_url) as pg:
        pg.up()
        pg.stall()
        source = PoolSource(
            pg.url_for(database_url), min_size=1, max_size=2, name="runlane-test-pool", timeout=3.0
        )
        failures: list[BaseException] = []

        def build() -> None:
            try:
                source.open()
            except BaseException as exc:
                failures.append(exc)

        builder = threading.Thread(target=build, name="runlane-test-builder")
        builder.start()
        try:
            wait_until(lambda: pg.unanswered() >= 1, timeout=10, what="the build to connect")
            began = time.monotonic()
            source.close(timeout=0.5)
            took = time.monotonic() - began
            assert took < 0.5 + ALLOWANCE, f"close(timeout=0.5) took {took:.2f}s"
        finally:
            pg.unstall()
            builder.join(10)
        assert not builder.is_alive()
        assert len(failures) == 1
        assert isinstance(failures[0], psycopg_pool.PoolClosed), repr(failures[0])
    _no_threads_of("runlane-test-")
