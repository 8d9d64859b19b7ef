"""Issue 40: one LISTEN connection per process and server, carrying every channel its
subscribers need (postgres/_listen_hub.py): a worker's announcements, a publisher-like
subscriber and ``wait_for_run``'s run ends share it; each channel's notifications reach only
its subscribers; a channel nobody needs any more is UNLISTENed while the others stay; after
the backend is terminated the new connection LISTENs on every channel again."""

from __future__ import annotations

import queue
import threading
import uuid
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from runlane import RunContext, task
from runlane.postgres import RunEnds
from runlane.postgres._listen_hub import SharedListener, shared_listeners
from runlane.postgres._sql import notify_channel
from tests.conftest import RunlaneFactory
from tests.helpers import poll

pytestmark = pytest.mark.timeout(60)


def _backends(db: psycopg.Connection[Any], *names: str) -> list[tuple[int, str]]:
    """The server's backends named like any of ``names``: (pid, last statement)."""
    rows = db.execute(
        "select pid, query from pg_stat_activity where application_name = any(%s)",
        (list(names),),
    ).fetchall()
    return [(int(pid), str(query)) for pid, query in rows]


def _subscriber(
    database_url: str, channel: str, name: str, *, check_pooler: bool = False
) -> tuple[SharedListener, queue.Queue[str | None]]:
    heard: queue.Queue[str | None] = queue.Queue()
    listener = SharedListener(
        connection_string=database_url,
        channel=channel,
        environment="default",
        on_wake=heard.put,
        name=name,
        check_pooler=check_pooler,
    )
    return listener, heard


def _next(heard: queue.Queue[str | None], timeout: float = 10.0) -> str | None:
    return heard.get(timeout=timeout)


def _quiet(heard: queue.Queue[str | None]) -> bool:
    """Nothing arrived (a notification already sent would be here after a round trip)."""
    return heard.empty()


def test_a_worker_a_subscriber_and_a_waiter_share_one_listen_backend(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], database_url: str, schema: str
) -> None:
    release = threading.Event()

    @task(id="shared.hold")
    def hold(payload: Any, context: RunContext) -> None:
        release.wait(20)

    # a long poll: only a notification starts a run within the test's waits
    rl = make_runlane(tasks=[hold], lane_options={"poll_interval": timedelta(seconds=30)})
    rl.start()
    worker = rl.create_delivery_worker(concurrency=1)
    # like the lane's listeners: its own connection string, checked for a pooler
    publisher, heard = _subscriber(
        database_url, notify_channel(schema), f"pub-{schema}"[:63], check_pooler=True
    )
    publisher.start()
    try:
        assert _next(heard) is None  # its channel is LISTENed
        run = rl.trigger(hold, 1)
        assert _next(heard) == "default"  # the trigger's announcement, to the subscriber too
        done: queue.Queue[Any] = queue.Queue()
        waiter = threading.Thread(
            target=lambda: done.put(rl.wait_for_run(run.id, timeout=20)), name="test-waiter"
        )
        waiter.start()
        ends = rl._life.end_watcher()  # its connection's name, to count it
        assert isinstance(ends, RunEnds)
        assert poll(lambda: ends.connected, timeout=10)
        names = (f"{worker.name}-listener", f"pub-{schema}"[:63], ends._listener.name)
        backends = _backends(db, *names)
        assert len(backends) == 1, backends  # before: the run ends had a connection of their own
        assert shared_listeners() == 1
        release.set()
        assert done.get(timeout=20).status == "completed"
        waiter.join(10)
        # the waiter left: the ends channel is UNLISTENed, the announcements stay
        ends_listen = 'unlisten "' + ends._listener.channel + '"'
        assert poll(lambda: _backends(db, *names)[0][1] == ends_listen, timeout=10), _backends(
            db, *names
        )
        assert not ends.connected
        while not heard.empty():
            heard.get()
        second = rl.trigger(hold, 2)
        assert _next(heard) == "default"
        assert rl.wait_for_run(second.id, timeout=10).status == "completed"  # woken at once
    finally:
        release.set()
        publisher.close(10)
        worker.close(timeout=10)


@pytest.fixture
def two_channels(database_url: str, schema: str) -> Any:
    a, heard_a = _subscriber(database_url, f"a-{schema}"[:63], f"sub-a-{schema}"[:63])
    b, heard_b = _subscriber(database_url, f"b-{schema}"[:63], f"sub-b-{schema}"[:63])
    a.start()
    b.start()
    try:
        assert _next(heard_a) is None  # told once its channel is LISTENed
        assert _next(heard_b) is None
        yield a, heard_a, b, heard_b
    finally:
        a.close(10)
        b.close(10)
    assert shared_listeners() == 0


def _notify(db: psycopg.Connection[Any], channel: str, payload: str) -> None:
    db.execute("select pg_notify(%s, %s)", (channel, payload))


def test_each_channel_reaches_only_its_subscribers(
    two_channels: Any, db: psycopg.Connection[Any]
) -> None:
    a, heard_a, b, heard_b = two_channels
    assert shared_listeners() == 1
    assert len(_backends(db, a.name, b.name)) == 1
    _notify(db, a.channel, "default|one")
    _notify(db, b.channel, "default|two")
    _notify(db, a.channel, "other|three")  # another environment: filtered out
    _notify(db, a.channel, "default|four")
    assert _next(heard_a) == "one"
    assert _next(heard_a) == "four"
    assert _next(heard_b) == "two"
    assert _quiet(heard_a)
    assert _quiet(heard_b)


def test_a_subscriber_that_raises_does_not_silence_the_others(
    database_url: str, schema: str, db: psycopg.Connection[Any]
) -> None:
    """One shared thread serves every subscriber: a callback that raises is logged, and the
    thread goes on delivering to the others (it used to end, leaving them all polling)."""
    channel = f"c-{schema}"[:63]
    heard: queue.Queue[str | None] = queue.Queue()

    def broken(payload: str | None) -> None:
        if payload is not None:
            raise RuntimeError("a broken callback")

    bad = SharedListener(
        connection_string=database_url,
        channel=channel,
        environment="default",
        on_wake=broken,
        name=f"bad-{schema}"[:63],
    )
    good, heard = _subscriber(database_url, channel, f"good-{schema}"[:63])
    bad.start()
    good.start()
    try:
        assert _next(heard) is None
        _notify(db, channel, "default|one")
        _notify(db, channel, "default|two")
        assert _next(heard) == "one"
        assert _next(heard) == "two"
    finally:
        bad.close(10)
        good.close(10)


def test_a_paused_channel_is_unlistened_and_the_other_stays(
    two_channels: Any, db: psycopg.Connection[Any]
) -> None:
    a, heard_a, b, heard_b = two_channels
    b.pause()
    assert not b.connected.is_set()
    assert poll(lambda: _backends(db, a.name)[0][1] == f'unlisten "{b.channel}"', timeout=10)
    _notify(db, b.channel, "default|lost")
    _notify(db, a.channel, "default|kept")
    assert _next(heard_a) == "kept"
    assert _quiet(heard_b)
    b.resume()
    assert _next(heard_b) is None  # LISTENed again: told it may have missed some
    assert b.connected.is_set()
    _notify(db, b.channel, "default|back")
    assert _next(heard_b) == "back"


def test_after_a_terminated_backend_both_channels_are_listened_again(
    two_channels: Any, db: psycopg.Connection[Any]
) -> None:
    a, heard_a, b, heard_b = two_channels
    [(pid, _)] = _backends(db, a.name)
    db.execute("select pg_terminate_backend(%s)", (pid,))
    assert _next(heard_a, 20) is None  # reconnected: every subscriber told
    assert _next(heard_b, 20) is None
    [(new_pid, _)] = _backends(db, a.name)
    assert new_pid != pid
    marker = uuid.uuid4().hex
    _notify(db, a.channel, f"default|{marker}")
    _notify(db, b.channel, f"default|{marker}")
    assert _next(heard_a) == marker
    assert _next(heard_b) == marker


def test_a_closed_worker_leaves_no_thread_or_backend_named_after_it(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any]
) -> None:
    """The connection is named after its first subscriber, the worker; once the worker
    closes while the runtime's run-end watcher stays, it takes the watcher's name."""

    @task(id="shared.quick")
    def quick(payload: Any, context: RunContext) -> None:
        return None

    rl = make_runlane(tasks=[quick])
    worker = rl.create_delivery_worker(concurrency=1)
    first = f"{worker.name}-listener"
    assert poll(lambda: len(_backends(db, first)) == 1, timeout=10)
    assert rl.wait_for_run(rl.trigger(quick, 1).id, timeout=10).status == "completed"
    ends = rl._life.end_watcher()
    assert isinstance(ends, RunEnds)
    worker.close(timeout=10)
    assert shared_listeners() == 1  # the watcher still holds it
    assert [t.name for t in threading.enumerate() if t.name.startswith(first)] == []
    assert poll(lambda: len(_backends(db, ends._listener.name)) == 1, timeout=10)
    assert _backends(db, first) == []
