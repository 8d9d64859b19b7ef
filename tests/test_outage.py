"""A database that is down, then back: clear errors at one boundary, and no poisoning.

Before: a database down when a runtime was first used poisoned it for good (``PoolTimeout``,
then ``PoolClosed`` forever after the database was back), and psycopg errors escaped public
methods. A loopback proxy (tests/_proxy.py) plays the outage in front of the real server.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import attrs
import psycopg
import psycopg_pool
import pytest

from runlane import (
    ConfigurationError,
    RunContext,
    RunStatus,
    StorageUnavailable,
    create_runlane,
    task,
)
from runlane.postgres import postgres_polling_lane
from tests._proxy import TcpProxy, tcp_proxy
from tests.helpers import wait_for_status


@attrs.frozen
class Item:
    n: int


@task(id="noop", schema=Item)
def noop(payload: Item, context: RunContext) -> int:
    return payload.n


@pytest.fixture
def proxy(database_url: str) -> Iterator[TcpProxy]:
    with tcp_proxy(database_url) as p:
        yield p


def _proxied(database_url: str, proxy: TcpProxy, **options: Any) -> str:
    # a password the server ignores (trust) but that must never appear in a message
    url = proxy.url_for(database_url)
    return f"{url} password=sekrit-pw"


def test_a_database_down_at_first_use_does_not_poison_the_runtime(
    database_url: str, schema: str, proxy: TcpProxy
) -> None:
    lane = postgres_polling_lane(
        connection_string=_proxied(database_url, proxy), schema=schema, connect_timeout=1
    )
    rl = create_runlane(lane=lane, tasks=[noop])
    try:
        with pytest.raises(StorageUnavailable) as info:
            rl.trigger(noop, Item(1))
        message = str(info.value)
        assert f"127.0.0.1:{proxy.port}" in message
        assert "sekrit" not in message
        assert not isinstance(info.value, psycopg.Error | psycopg_pool.PoolTimeout)
        with pytest.raises(StorageUnavailable):
            rl.start()
        proxy.up()  # the database is back: the very next call works
        handle = rl.trigger(noop, Item(2))
        assert rl.get_run(handle.id).status is RunStatus.QUEUED
        assert rl.drain().runs_executed == 1
        assert rl.get_run(handle.id).output == 2
    finally:
        rl.close()


def test_every_public_method_says_storage_unavailable_while_down(
    database_url: str, schema: str, proxy: TcpProxy
) -> None:
    lane = postgres_polling_lane(
        connection_string=_proxied(database_url, proxy), schema=schema, connect_timeout=1
    )
    rl = create_runlane(lane=lane, tasks=[noop])
    some = uuid.uuid4()
    calls = {
        "trigger": lambda: rl.trigger(noop, Item(1)),
        "get_run": lambda: rl.get_run(some),
        "cancel": lambda: rl.cancel(some),
        "create_wait_token": rl.create_wait_token,
        "drain": rl.drain,
        "run_maintenance_once": rl.run_maintenance_once,
        "status": rl.status,
    }
    try:
        for name, call in calls.items():
            with pytest.raises(StorageUnavailable, match=f"127.0.0.1:{proxy.port}"):
                call()
            assert name
    finally:
        rl.close()


def test_a_worker_rides_out_an_outage(
    database_url: str, schema: str, proxy: TcpProxy, make_runlane: Any
) -> None:
    proxy.up()
    lane = postgres_polling_lane(
        connection_string=_proxied(database_url, proxy), schema=schema, connect_timeout=1
    )
    rl = create_runlane(lane=lane, tasks=[noop])
    direct = make_runlane(tasks=[noop])  # the producer reaches the database directly
    try:
        with rl.create_delivery_worker(concurrency=2) as worker:
            first = direct.trigger(noop, Item(1))
            wait_for_status(direct, first.id, RunStatus.COMPLETED)
            proxy.down()
            during = direct.trigger(noop, Item(2))
            proxy.up()
            wait_for_status(direct, during.id, RunStatus.COMPLETED, timeout=20)
        assert worker.wait_until_closed(0) is True
    finally:
        rl.close()


def test_a_malformed_connection_string_is_a_configuration_error() -> None:
    for bad in (
        "postgresql://u:pw@host:notaport/db",
        "hostx=foo password=pw@",
        "not a = conn = string",
        "host='unterminated",
        "",
    ):
        with pytest.raises(ConfigurationError) as info:
            postgres_polling_lane(connection_string=bad)
        assert "pw@" not in str(info.value)
