"""wait_for_run wakes on the run's end (LISTEN/NOTIFY on the schema's ends channel, migration
9), with polling as the fallback."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from runlane import RunContext, RunlaneClosed, RunNotFound, RunStatus, task
from runlane.models import RunSnapshot
from runlane.postgres._ends import ends_channel
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, wait_until


@task(id="ends.echo")
def echo(payload: Any, context: RunContext) -> Any:
    return payload


def listening(db: Conn, schema: str) -> int:
    """Connections of run-end listeners whose last statement is the LISTEN on ``schema``'s
    ends channel (each xdist worker has a server of its own; the schema keeps other tests'
    listeners out)."""
    row = db.execute(
        "select count(*) from pg_stat_activity "
        "where application_name like 'runlane-run-ends-%%' and query = %s",
        (f'listen "{ends_channel(schema)}"',),
    ).fetchone()
    assert row is not None
    return int(row[0])


class Waiter:
    """``wait_for_run`` in a thread of its own, remembering what and when it returned."""

    def __init__(self, wait: Any, *args: Any, **kwargs: Any) -> None:
        self.result: RunSnapshot | BaseException | None = None
        self.returned_at = 0.0
        self.done = threading.Event()

        def main() -> None:
            try:
                self.result = wait(*args, **kwargs)
            except BaseException as exc:
                self.result = exc
            self.returned_at = time.monotonic()
            self.done.set()

        self.thread = threading.Thread(target=main, name="test-wait-for-run")
        self.thread.start()

    def join(self) -> RunSnapshot:
        assert self.done.wait(30)
        self.thread.join(5)
        assert isinstance(self.result, RunSnapshot), self.result
        return self.result


@pytest.fixture
def no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback poll of a connected waiter pushed to 30 s: only an announcement can wake
    it within the test's bound."""
    monkeypatch.setattr("runlane.runtime._waiting._ENDS_FALLBACK_POLL_SECONDS", 30.0)


@pytest.mark.usefixtures("no_fallback")
@pytest.mark.parametrize("how", ["completed", "cancelled"])
def test_a_waiter_wakes_when_the_run_ends_in_another_runtime(
    make_runlane: RunlaneFactory, db: Conn, schema: str, how: str
) -> None:
    waiting = make_runlane(tasks=[echo])
    other = make_runlane(tasks=[echo])
    handle = waiting.trigger(echo, {"n": 1})
    waiter = Waiter(waiting.wait_for_run, handle.id, timeout=60)
    wait_until(lambda: listening(db, schema) == 1, timeout=10, what="the run-end listener")
    # (ending the run before the waiter's first look would only make it return sooner)
    ended_at = time.monotonic()
    if how == "completed":
        assert other.drain().runs_executed == 1
    else:
        other.cancel(handle.id)
    snapshot = waiter.join()
    assert snapshot.status is (RunStatus.COMPLETED if how == "completed" else RunStatus.CANCELLED)
    # woken by the announcement: the fallback would have waited 30 s
    assert waiter.returned_at - ended_at < 2.0


@pytest.mark.usefixtures("no_fallback")
def test_one_listener_serves_many_waiters_and_each_wakes_for_its_own_run(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    waiting = make_runlane(tasks=[echo])
    other = make_runlane(tasks=[echo])
    first, second = waiting.trigger_many(echo, [{"n": 1}, {"n": 2}])
    waiters = [Waiter(waiting.wait_for_run, h.id, timeout=60) for h in (first, second)]
    wait_until(lambda: listening(db, schema) == 1, timeout=10, what="one run-end listener")
    assert other.drain(max_runs=1).runs_executed == 1  # FIFO: the first run
    assert waiters[0].join().output == {"n": 1}
    assert not waiters[1].done.wait(0.3)  # its run has not ended
    assert other.drain().runs_executed == 1
    assert waiters[1].join().output == {"n": 2}


def test_without_listen_it_polls(make_runlane: RunlaneFactory, db: Conn, schema: str) -> None:
    """Poll-only mode (``listen=False``, for poolers that cannot LISTEN) opens no listener."""
    waiting = make_runlane(tasks=[echo], lane_options={"listen": False})
    other = make_runlane(tasks=[echo])
    handle = waiting.trigger(echo, {"n": 3})
    waiter = Waiter(waiting.wait_for_run, handle.id, timeout=60)
    assert not waiter.done.wait(0.2)
    assert other.drain().runs_executed == 1
    assert waiter.join().output == {"n": 3}
    assert listening(db, schema) == 0


def test_timeout_unknown_run_and_close(make_runlane: RunlaneFactory, db: Conn, schema: str) -> None:
    waiting = make_runlane(tasks=[echo])
    handle = waiting.trigger(echo, {"n": 4})
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="still queued"):
        waiting.wait_for_run(handle.id, timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 3.0
    with pytest.raises(RunNotFound):
        waiting.wait_for_run("01890000-0000-7000-8000-000000000000", timeout=1)
    waiting.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("runlane-run-ends-")]
    wait_until(
        lambda: listening(db, schema) == 0, timeout=10, what="the listener's connection closed"
    )
    with pytest.raises(RunlaneClosed):
        waiting.wait_for_run(handle.id, timeout=1)


def test_a_run_already_ended_is_returned_without_a_listener(
    make_runlane: RunlaneFactory,
) -> None:
    rl = make_runlane(tasks=[echo])
    handle = rl.trigger(echo, {"n": 5})
    assert rl.drain().runs_executed == 1
    assert rl.wait_for_run(handle.id, timeout=5).output == {"n": 5}
    assert not [t for t in threading.enumerate() if t.name.startswith("runlane-run-ends-")]
