"""Flow control (SPEC section 9, docs/flow-control.md): RateLimit and key_concurrency_limit
with trigger(..., concurrency_key=...), counted in Postgres at the claim, so they hold for
workers in this process and in others, for drain() and for the RabbitMQ lane."""

from __future__ import annotations

import secrets
import textwrap
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from runlane import (
    ConfigurationError,
    RateLimit,
    RetryPolicy,
    RunContext,
    RunHandle,
    Runlane,
    RunStatus,
    create_runlane,
    queue,
    task,
)
from runlane.postgres import _flow, grant_postgres_role, postgres_polling_lane
from runlane.storage import QueueLimits
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, SchemaDb, q, ready_process, storage_of, wait_until

ONCE = RetryPolicy(max_attempts=1)
LEASE = timedelta(seconds=30)


@task(id="flow.pause", retry=ONCE)
def pause(payload: Any, context: RunContext) -> None:
    """Hold the attempt for the payload's seconds (0 by default)."""
    time.sleep(float((payload or {}).get("seconds", 0)))


@task(id="flow.noop", retry=ONCE)
def noop(payload: Any, context: RunContext) -> None:
    return None


class FlowDb(SchemaDb):
    """What the attempts and runs of a queue say about its limits (database times)."""

    def starts(self, queue_name: str) -> list[datetime]:
        """Every attempt start of the queue: finished attempts and current ones."""
        rows = self.all(
            "select a.started_at from {schema}.attempts as a "
            "join {schema}.runs as r on r.id = a.run_id where r.queue = %s "
            "union all select attempt_started_at from {schema}.runs "
            "where queue = %s and status in ('running', 'cancellation_requested')",
            queue_name,
            queue_name,
        )
        return sorted(row[0] for row in rows)

    def intervals(self, queue_name: str) -> list[tuple[str | None, datetime, datetime]]:
        """(key, start, end) of the queue's finished attempts: the time each held a lease."""
        return [
            (row[0], row[1], row[2])
            for row in self.all(
                "select r.concurrency_key, a.started_at, a.finished_at from {schema}.attempts a "
                "join {schema}.runs r on r.id = a.run_id where r.queue = %s",
                queue_name,
            )
        ]

    def statuses(self, queue_name: str) -> Counter[str]:
        return Counter(
            {
                str(row[0]): int(row[1])
                for row in self.all(
                    "select status, count(*) from {schema}.runs where queue = %s group by 1",
                    queue_name,
                )
            }
        )

    def queued_keyed(self, queue_name: str, key: str | None, count: int) -> None:
        """``count`` runs of task flow.noop queued now with ``key``, written in one statement."""
        self.run(
            "insert into {schema}.runs (id, environment, task_id, queue, status, payload, "
            "max_attempts, due_at, concurrency_key) select gen_random_uuid(), 'default', "
            "'flow.noop', %s, 'queued', 'null', 1, now() - interval '1 hour', %s "
            "from generate_series(1, %s)",
            queue_name,
            key,
            count,
        )


def peak_per_key(intervals: Sequence[tuple[str | None, datetime, datetime]]) -> dict[str, int]:
    """The most attempts of each key holding a lease at once (an end before a start at the
    same instant: the claim came after the completion committed)."""
    events: dict[str, list[tuple[datetime, int]]] = {}
    for key, start, end in intervals:
        name = key or ""
        events.setdefault(name, []).extend([(start, 1), (end, -1)])
    peaks = {}
    for key, items in events.items():
        level = peak = 0
        for _, step in sorted(items):
            level += step
            peak = max(peak, level)
        peaks[key] = peak
    return peaks


def most_in_a_window(starts: Sequence[datetime], per: timedelta) -> int:
    """The most starts in any half-open window [t, t + per)."""
    best = 0
    j = 0
    for i, start in enumerate(starts):
        j = max(j, i)
        while j < len(starts) and starts[j] < start + per:
            j += 1
        best = max(best, j - i)
    return best


# -- definitions and bad input --------------------------------------------------------------------


def test_rate_limit_and_key_limit_are_part_of_the_queue_and_listed(
    make_runlane: RunlaneFactory,
) -> None:
    limit = RateLimit(100, timedelta(seconds=1), burst=10)
    rl = make_runlane(
        tasks=[noop],
        queues=[queue("mail", rate_limit=limit), queue("per-customer", key_concurrency_limit=2)],
    )
    infos = {info.name: info for info in rl.list_queues()}
    assert infos["mail"].rate_limit == limit
    assert infos["mail"].key_concurrency_limit is None
    assert infos["per-customer"].key_concurrency_limit == 2
    assert RateLimit(5, 2).per == timedelta(seconds=2)
    assert repr(limit) == "RateLimit(100, 1, burst=10)"


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((0, 1), {}, "count must be an integer from 1"),
        ((-5, 1), {}, "count must be an integer from 1"),
        ((True, 1), {}, "count must be an integer"),
        ((1.5, 1), {}, "count must be an integer"),
        ((10, 0), {}, "per must be a positive period"),
        ((10, -1), {}, "per must be a positive period"),
        ((10, float("nan")), {}, "per must be a positive period"),
        ((10, timedelta(0)), {}, "per must be from 1 millisecond to 1 day"),
        ((10, timedelta(days=2)), {}, "per must be from 1 millisecond to 1 day"),
        ((10, "1s"), {}, "per must be a timedelta or a number of seconds"),
        ((2000, timedelta(milliseconds=1)), {}, "more than one start a microsecond"),
        ((10, 1), {"burst": 11}, "burst must be an integer from 0 to 10"),
        ((10, 1), {"burst": -1}, "burst must be an integer from 0 to 10"),
        ((10, 1), {"burst": 10**30}, "burst must be an integer from 0 to 10"),
    ],
)
def test_a_bad_rate_limit_is_refused(
    args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        RateLimit(*args, **kwargs)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "1", 2**31])
def test_a_bad_key_concurrency_limit_is_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="key_concurrency_limit must be an integer"):
        queue("q", key_concurrency_limit=bad)  # type: ignore[arg-type]


def test_a_rate_limit_that_is_not_a_rate_limit_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"rate_limit must be a runlane\.RateLimit"):
        queue("q", rate_limit=100)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("k" * 201, "at most 200 bytes in UTF-8, got 201 bytes"),
        ("é" * 101, "at most 200 bytes in UTF-8, got 202 bytes"),
        ("a\x00b", "must not contain the NUL character"),
        ("", "non-empty string"),
        (42, "non-empty string"),
        ("\ud800", "lone surrogate"),
    ],
)
def test_a_bad_concurrency_key_is_refused_and_nothing_is_written(
    make_runlane: RunlaneFactory, db: Conn, schema: str, key: object, message: str
) -> None:
    rl = make_runlane(tasks=[noop], queues=[queue("keyed", key_concurrency_limit=1)])
    for call in (
        lambda: rl.trigger(noop, None, queue="keyed", concurrency_key=key),  # type: ignore[arg-type]
        lambda: rl.trigger_many(noop, [1, 2], queue="keyed", concurrency_key=key),  # type: ignore[arg-type]
    ):
        with pytest.raises(ConfigurationError, match=message):
            call()
    assert FlowDb(db, schema).statuses("keyed") == Counter()


def test_a_key_at_200_bytes_is_stored(make_runlane: RunlaneFactory, db: Conn, schema: str) -> None:
    rl = make_runlane(tasks=[noop], queues=[queue("keyed", key_concurrency_limit=1)])
    key = "é" * 100  # 200 bytes
    handle = rl.trigger(noop, None, queue="keyed", concurrency_key=key)
    assert FlowDb(db, schema).one(
        "select concurrency_key from {schema}.runs where id = %s", handle.id
    ) == (key,)


def test_a_key_for_a_queue_without_a_key_limit_is_refused(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    rl = make_runlane(tasks=[noop], queues=[queue("plain", default=True)])
    with pytest.raises(ConfigurationError, match="has no key_concurrency_limit"):
        rl.trigger(noop, None, concurrency_key="customer-1")
    assert FlowDb(db, schema).statuses("plain") == Counter()


def test_every_trigger_path_stores_the_key(
    make_runlane: RunlaneFactory, db: Conn, schema: str, database_url: str
) -> None:
    @task(id="flow.parent", queue="keyed", retry=ONCE)
    def parent(payload: Any, context: RunContext) -> None:
        context.trigger_child(noop, None, queue="keyed", concurrency_key="child-key")

    rl = make_runlane(tasks=[noop, parent], queues=[queue("keyed", key_concurrency_limit=5)])
    flow = FlowDb(db, schema)
    one = rl.trigger(noop, None, queue="keyed", concurrency_key="a")
    keyed = rl.trigger(noop, None, queue="keyed", concurrency_key="b", idempotency_key="i-1")
    many = rl.trigger_many(noop, [1, 2], queue="keyed", concurrency_key="c")
    with psycopg.connect(database_url) as conn:
        inside = rl.trigger(noop, None, queue="keyed", concurrency_key="d", connection=conn)
    rl.trigger(parent, None, concurrency_key="p")
    rl.drain(queues=["keyed"])
    keys = dict(flow.all("select id, concurrency_key from {schema}.runs"))
    assert keys[one.id] == "a"
    assert keys[keyed.id] == "b"
    assert {keys[h.id] for h in many} == {"c"}
    assert keys[inside.id] == "d"
    assert sorted(keys.values()) == ["a", "b", "c", "c", "child-key", "d", "p"]


# -- per-key concurrency --------------------------------------------------------------------------

_OTHER_WORKER = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    from runlane import RateLimit, RetryPolicy, create_runlane, queue, task
    from runlane.postgres import postgres_polling_lane

    @task(id="flow.pause", retry=RetryPolicy(max_attempts=1))
    def pause(payload, context):
        time.sleep(float((payload or {}).get("seconds", 0)))

    rate = RateLimit(int(sys.argv[3]), float(sys.argv[4])) if len(sys.argv) > 3 else None
    rl = create_runlane(
        lane=postgres_polling_lane(connection_string=sys.argv[1], schema=sys.argv[2],
                                   poll_interval=timedelta(seconds=1)),
        tasks=[pause],
        queues=[queue("keyed", key_concurrency_limit=2), queue("rated", rate_limit=rate)],
    )
    with rl.create_delivery_worker(concurrency=4):
        print("ready", flush=True)
        sys.stdin.read()
    rl.close()
    """
)


def test_at_most_n_attempts_per_key_run_at_once_across_processes(
    make_runlane: RunlaneFactory, db: Conn, schema: str, database_url: str
) -> None:
    rl = make_runlane(
        tasks=[pause], queues=[queue("keyed", key_concurrency_limit=2), queue("rated")]
    )
    flow = FlowDb(db, schema)
    with (
        ready_process(_OTHER_WORKER, database_url, schema),
        ready_process(_OTHER_WORKER, database_url, schema),
        rl.create_delivery_worker(concurrency=4),
    ):
        for key in ("a", "b", "c"):
            rl.trigger_many(pause, [{"seconds": 0.05}] * 8, queue="keyed", concurrency_key=key)
        wait_until(
            lambda: flow.statuses("keyed") == Counter(completed=24),
            timeout=30,
            what="every keyed run to complete",
            state=lambda: flow.statuses("keyed"),
        )
    peaks = peak_per_key(flow.intervals("keyed"))
    # never above the limit, and the limit was used (12 slots across 3 processes)
    assert peaks == {"a": 2, "b": 2, "c": 2}


def test_a_key_with_a_huge_backlog_does_not_delay_other_keys(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    rl = make_runlane(tasks=[noop], queues=[queue("keyed", key_concurrency_limit=1)])
    flow = FlowDb(db, schema)
    flow.queued_keyed("keyed", "hot", 20_000)  # older than every other run: at the head
    flow.run("analyze {schema}.runs")
    others = []
    for i in range(40):
        others += rl.trigger_many(noop, [None] * 5, queue="keyed", concurrency_key=f"k{i}")
    started = time.monotonic()
    with rl.create_delivery_worker(concurrency=4):
        for handle in others:
            assert rl.wait_for_run(handle.id, timeout=30).status is RunStatus.COMPLETED
        took = time.monotonic() - started
        (hot_started,) = flow.one(
            "select count(*) from {schema}.runs where concurrency_key = 'hot' "
            "and status <> 'queued'"
        )
    # the other keys did not wait behind the hot key's backlog: they were all done while
    # it had run a few dozen of its 20,000 (one at a time, taking a turn whenever its slot
    # was free), not after it
    assert hot_started < 1_000, f"the hot key started {hot_started} runs meanwhile"
    assert took < 60, f"200 runs of 40 other keys took {took:.1f}s behind the hot key"
    assert max(peak_per_key(flow.intervals("keyed")).values()) == 1


def test_an_expired_lease_frees_its_keys_slot(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    rl = make_runlane(tasks=[noop], queues=[queue("keyed", key_concurrency_limit=1)])
    handles = rl.trigger_many(noop, [1, 2], queue="keyed", concurrency_key="k")
    storage = storage_of(rl)
    limits = QueueLimits(key_limit=1)
    first = storage.run_claim_limited("default", "keyed", limits, 10, LEASE).runs
    assert [c.id for c in first] == [handles[0].id]
    assert storage.run_claim_limited("default", "keyed", limits, 10, LEASE).runs == []
    FlowDb(db, schema).run(
        "update {schema}.runs set lease_expires_at = now() - interval '1 second' where id = %s",
        handles[0].id,
    )
    second = storage.run_claim_limited("default", "keyed", limits, 10, LEASE).runs
    assert [c.id for c in second] == [handles[1].id]


def test_keys_take_turns_and_runs_stored_without_a_key_are_claimed(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    rl = make_runlane(tasks=[noop], queues=[queue("keyed", key_concurrency_limit=1)])
    flow = FlowDb(db, schema)
    flow.queued_keyed("keyed", None, 2)  # queued before the queue had the limit
    for key in ("a", "b", "c"):
        rl.trigger_many(noop, [None] * 3, queue="keyed", concurrency_key=key)
    storage = storage_of(rl)
    limits = QueueLimits(key_limit=1)
    claimed = storage.run_claim_limited("default", "keyed", limits, 2, LEASE).runs
    assert len(claimed) == 2
    keys = flow.all(
        "select concurrency_key from {schema}.runs where id = any(%s)", [c.id for c in claimed]
    )
    assert keys == [(None,), (None,)]  # the head of the queue: no key, no per-key limit
    taken: list[str] = []
    for _ in range(3):
        (run,) = storage.run_claim_limited("default", "keyed", limits, 1, LEASE).runs
        (key,) = flow.one("select concurrency_key from {schema}.runs where id = %s", run.id)
        taken.append(key)
    assert taken == ["a", "b", "c"]  # one key after another, round robin
    assert storage.run_claim_limited("default", "keyed", limits, 5, LEASE).runs == []


def test_runs_held_back_are_neither_claimed_nor_written(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    rl = make_runlane(
        tasks=[noop],
        queues=[queue("keyed", key_concurrency_limit=1, rate_limit=RateLimit(1, 60))],
    )
    flow = FlowDb(db, schema)
    flow.queued_keyed("keyed", "hot", 1_000)
    storage = storage_of(rl)
    limits = QueueLimits.of(queue("keyed", key_concurrency_limit=1, rate_limit=RateLimit(1, 60)))
    assert len(storage.run_claim_limited("default", "keyed", limits, 10, LEASE).runs) == 1

    def versions() -> list[tuple[Any, ...]]:
        return flow.all(
            "select 'runs', ctid::text, xmin::text from {schema}.runs union all "
            "select 'flow', ctid::text, xmin::text from {schema}.queue_flow union all "
            "select 'starts', ctid::text, xmin::text from {schema}.queue_starts order by 1, 2"
        )

    before = versions()
    for _ in range(50):
        result = storage.run_claim_limited("default", "keyed", limits, 10, LEASE)
        assert result.runs == []
        assert result.rate_wait is not None
        assert 0 < result.rate_wait <= 60
    assert versions() == before  # not one row version written while they wait


# -- rate limits ----------------------------------------------------------------------------------


def test_a_rate_limit_holds_across_worker_processes_and_is_reached(
    make_runlane: RunlaneFactory, db: Conn, schema: str, database_url: str
) -> None:
    count, per = 20, timedelta(seconds=0.5)
    rl = make_runlane(
        tasks=[pause],
        queues=[
            queue("keyed", key_concurrency_limit=2),
            queue("rated", rate_limit=RateLimit(count, per)),
        ],
        lane_options={"poll_interval": timedelta(seconds=1)},
    )
    flow = FlowDb(db, schema)
    args = (database_url, schema, str(count), str(per.total_seconds()))
    with (
        ready_process(_OTHER_WORKER, *args),
        ready_process(_OTHER_WORKER, *args),
        rl.create_delivery_worker(concurrency=4),
    ):
        rl.trigger_many(pause, [None] * 100, queue="rated")
        wait_until(
            lambda: flow.statuses("rated") == Counter(completed=100),
            timeout=30,
            what="every rated run to complete",
            state=lambda: flow.statuses("rated"),
        )
    starts = flow.starts("rated")
    assert most_in_a_window(starts, per) == count  # never above the limit, and reached
    # 100 runs at 20 per half second: 5 windows, started over at least 2 seconds, and the
    # workers kept up with the limit (the last window began within a second of the ideal)
    span = (starts[-1] - starts[0]).total_seconds()
    assert 2.0 <= span < 3.0


def test_a_rate_limit_with_burst_spreads_the_starts(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    limit = RateLimit(10, timedelta(seconds=1), burst=2)
    rl = make_runlane(tasks=[noop], queues=[queue("rated", rate_limit=limit)])
    rl.trigger_many(noop, [None] * 12, queue="rated")
    storage = storage_of(rl)
    limits = QueueLimits.of(queue("rated", rate_limit=limit))
    first = storage.run_claim_limited("default", "rated", limits, 12, LEASE)
    assert len(first.runs) == 3  # burst + 1 at once after a quiet spell
    assert first.rate_wait is not None
    assert 0.05 < first.rate_wait <= 0.1  # then one every per / count
    began = _last_start(db, schema)
    second = storage.run_claim_limited("default", "rated", limits, 12, LEASE)
    if second.runs:
        # a busy machine took longer than rate_wait between the two claims: only what the
        # limit allows by the database's clock at the second claim may have started
        waited = _last_start(db, schema) - began
        assert waited >= first.rate_wait, f"claimed {len(second.runs)} after {waited:.3f}s"
        assert len(second.runs) <= 1 + int((waited - first.rate_wait) / 0.1)
    else:
        assert second.rate_wait is not None
        assert 0 < second.rate_wait <= first.rate_wait
    latest = second if second.runs else first
    assert latest.rate_wait is not None
    # the wait passes on the database's clock: the queue's rate state is moved to where it
    # would be had the latest claim been made rate_wait ago, however long the calls since
    # took (a sleep of rate_wait overslept on a busy machine into a second start)
    db.execute(
        q(
            "update {s}.queue_flow set "
            "rate_tat = rate_tat - (last_start + make_interval(secs => %s) - clock_timestamp()), "
            "last_start = clock_timestamp() - make_interval(secs => %s)",
            schema,
        ),
        (latest.rate_wait, latest.rate_wait),
    )
    allowed_from = _last_start(db, schema) + latest.rate_wait
    third = storage.run_claim_limited("default", "rated", limits, 12, LEASE).runs
    late = _last_start(db, schema) - allowed_from  # 0 unless the machine was busy
    assert 1 <= len(third) <= 1 + int(late / 0.1)


def _last_start(db: Conn, schema: str) -> float:
    """The rated queue's last start by the database's clock, in epoch seconds."""
    row = db.execute(
        q(
            "select extract(epoch from last_start)::float8 from {s}.queue_flow "
            "where queue = 'rated'",
            schema,
        )
    ).fetchone()
    assert row is not None
    return float(row[0])


def test_drain_waits_for_the_rate_limit_and_obeys_key_limits(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    # drain runs one attempt at a time: a window of a second leaves each of the window's ten
    # starts 100 ms, so the limit is reached on a busy machine too (0.3 s left 30 ms each:
    # 7 of 10 at a load average of 19)
    count, per = 10, timedelta(seconds=1)
    rl = make_runlane(
        tasks=[pause],
        queues=[
            queue("rated", rate_limit=RateLimit(count, per)),
            queue("keyed", key_concurrency_limit=1),
        ],
    )
    flow = FlowDb(db, schema)
    rl.trigger_many(pause, [None] * 25, queue="rated")
    started = time.monotonic()
    assert rl.drain(queues=["rated"]).runs_executed == 25
    assert time.monotonic() - started >= 2 * per.total_seconds()  # three windows
    assert most_in_a_window(flow.starts("rated"), per) == count
    for key in ("a", "b"):
        rl.trigger_many(pause, [None] * 5, queue="keyed", concurrency_key=key)
    assert rl.drain(queues=["keyed"]).runs_executed == 10
    assert peak_per_key(flow.intervals("keyed")) == {"a": 1, "b": 1}


def test_stamps_never_go_back_whatever_the_stored_times_say(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    """A database clock stepped back (stored stamps in the future) cannot reopen a window."""
    rl = make_runlane(tasks=[noop], queues=[queue("rated", rate_limit=RateLimit(2, 60))])
    rl.trigger_many(noop, [None] * 6, queue="rated")
    storage = storage_of(rl)
    limits = QueueLimits.of(queue("rated", rate_limit=RateLimit(2, 60)))
    assert len(storage.run_claim_limited("default", "rated", limits, 6, LEASE).runs) == 2
    flow = FlowDb(db, schema)
    flow.run("update {schema}.queue_starts set started_at = started_at + interval '1 hour'")
    flow.run("update {schema}.queue_flow set last_start = last_start + interval '1 hour'")
    assert storage.run_claim_limited("default", "rated", limits, 6, LEASE).runs == []
    # the window moves with the stamps: 60 s after the last one, not after the wall clock
    flow.run("update {schema}.queue_starts set started_at = started_at - interval '2 hours'")
    flow.run("update {schema}.queue_flow set last_start = last_start - interval '2 hours'")
    assert len(storage.run_claim_limited("default", "rated", limits, 6, LEASE).runs) == 2


# -- the RabbitMQ lane ----------------------------------------------------------------------------


def test_the_rabbitmq_lane_obeys_key_limits_and_defers_held_back_deliveries(
    rabbit_runtime: Any, rabbitmq_url: str, db: Conn, schema: str
) -> None:
    name = f"keyed{uuid.uuid4().hex[:8]}"
    held_back = threading.Event()

    @task(id="flow.rabbit", queue=name, retry=ONCE)
    def rabbit(payload: Any, context: RunContext) -> None:
        # each key's first run holds its slot until deliveries were held back meanwhile
        held_back.wait(30)

    rl = rabbit_runtime(
        amqp_url=rabbitmq_url,
        tasks=[rabbit],
        queues=[queue(name, key_concurrency_limit=1)],
        defer_delay=timedelta(milliseconds=100),
    )
    flow = FlowDb(db, schema)
    with rl.create_delivery_worker(concurrency=4) as worker:
        stats = worker.acquirer.stats
        assert worker.acquirer.consuming.wait(15), "the consumer"
        handles = []
        for key in ("a", "b", "c"):
            handles += rl.trigger_many(rabbit, [None] * 4, concurrency_key=key)
        wait_until(lambda: stats.deferred > 0, timeout=30, what="a delivery held back")
        held_back.set()
        for h in handles:
            assert rl.wait_for_run(h.id, timeout=30).status is RunStatus.COMPLETED
    assert peak_per_key(flow.intervals(name)) == {"a": 1, "b": 1, "c": 1}
    assert stats.deferred > 0  # the held-back deliveries went back through the outbox


def test_the_rabbitmq_lane_obeys_a_rate_limit(
    rabbit_runtime: Any, rabbitmq_url: str, db: Conn, schema: str
) -> None:
    name = f"rated{uuid.uuid4().hex[:8]}"
    count, per = 5, timedelta(seconds=0.5)

    @task(id="flow.rabbit_rated", queue=name, retry=ONCE)
    def rated(payload: Any, context: RunContext) -> None:
        return None

    rl = rabbit_runtime(
        amqp_url=rabbitmq_url,
        tasks=[rated],
        queues=[queue(name, rate_limit=RateLimit(count, per))],
        defer_delay=timedelta(milliseconds=100),
    )
    flow = FlowDb(db, schema)
    with rl.create_delivery_worker(concurrency=4) as worker:
        assert worker.acquirer.consuming.wait(15), "the consumer"
        handles = rl.trigger_many(rated, [None] * 15)
        for h in handles:
            assert rl.wait_for_run(h.id, timeout=30).status is RunStatus.COMPLETED
    starts = flow.starts(name)
    assert len(starts) == 15
    assert most_in_a_window(starts, per) == count
    assert worker.acquirer.stats.deferred > 0


def _keys_not_due_then_one_due(
    make_runlane: RunlaneFactory, monkeypatch: pytest.MonkeyPatch, *, keys: int
) -> tuple[Runlane, RunHandle]:
    """A queue limited to one run a key, claims that look at 5 keys each, ``keys`` keys
    whose only runs are not due for an hour, then one due run of key "z" (the last key)."""
    monkeypatch.setattr(_flow, "KEY_VISIT_LIMIT", 5)
    rl = make_runlane(tasks=[noop], queues=[queue("keyed", key_concurrency_limit=1)])
    for i in range(keys):
        rl.trigger(noop, None, queue="keyed", concurrency_key=f"a{i:02d}", delay=3600)
    return rl, rl.trigger(noop, None, queue="keyed", concurrency_key="z")


def test_a_walk_past_many_keys_with_nothing_due_goes_on_where_it_stopped(
    make_runlane: RunlaneFactory, db: Conn, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rl, due = _keys_not_due_then_one_due(make_runlane, monkeypatch, keys=10)
    storage = storage_of(rl)
    limits = QueueLimits(key_limit=1)
    claims = [storage.run_claim_limited("default", "keyed", limits, 5, LEASE) for _ in range(3)]
    assert [[run.id for run in claim.runs] for claim in claims] == [[], [], [due.id]]
    # the two empty claims say their walk stopped at the visit limit, the last one does not
    assert [claim.walked_on for claim in claims] == [True, True, False]
    assert FlowDb(db, schema).statuses("keyed") == Counter(queued=10, running=1)


def test_drain_walks_on_past_keys_with_nothing_due(
    make_runlane: RunlaneFactory, db: Conn, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SPEC: drain returns when no work is due; scan-only pages do not spend max_runs. Its
    # first claim stops at the visit limit among keys with nothing due; it then walks the
    # rest of the keys in one claim rather than take that for "nothing due"
    rl, due = _keys_not_due_then_one_due(make_runlane, monkeypatch, keys=12)
    assert rl.drain(max_runs=1).runs_executed == 1
    assert rl.get_run(due.id).status is RunStatus.COMPLETED
    # and, with nothing due anywhere, a drain returns (the whole walk found nothing)
    later = rl.trigger(noop, None, queue="keyed", concurrency_key="zz")
    assert rl.drain().runs_executed == 1
    assert rl.get_run(later.id).status is RunStatus.COMPLETED
    assert rl.drain().runs_executed == 0
    assert FlowDb(db, schema).statuses("keyed") == Counter(queued=12, completed=2)


# -- least-privilege roles ---------------------------------------------------------------------


@pytest.fixture
def role_of(database_url: str, schema: str, db: Conn) -> Iterator[Callable[[str], str]]:
    """``role_of(job)``: the conninfo of a fresh LOGIN role granted ``job`` on the schema."""
    made: list[str] = []

    def make(job: str) -> str:
        name, password = f"rl_{uuid.uuid4().hex[:12]}", secrets.token_urlsafe(16)
        db.execute(
            sql.SQL("create role {} login password {}").format(
                sql.Identifier(name), sql.Literal(password)
            )
        )
        made.append(name)
        grant_postgres_role(connection_string=database_url, schema=schema, job=job, role=name)
        return make_conninfo(database_url, user=name, password=password)

    yield make
    for name in made:
        db.execute(
            "select pg_terminate_backend(pid) from pg_stat_activity where usename = %s", (name,)
        )
        db.execute(sql.SQL("drop owned by {}").format(sql.Identifier(name)))
        db.execute(sql.SQL("drop role {}").format(sql.Identifier(name)))


def test_the_producer_and_worker_roles_may_do_what_flow_control_needs(
    role_of: Callable[[str], str], schema: str, db: Conn
) -> None:
    queues = [
        queue("keyed", key_concurrency_limit=1),
        queue("rated", rate_limit=RateLimit(3, 60), default=True),
    ]

    def runtime(job: str) -> Runlane:
        lane = postgres_polling_lane(connection_string=role_of(job), schema=schema)
        return create_runlane(lane=lane, tasks=[noop], queues=queues)

    producer, worker = runtime("producer"), runtime("worker")
    try:
        producer.trigger_many(noop, [None] * 4, queue="keyed", concurrency_key="k")
        producer.trigger_many(noop, [None] * 5)
        assert worker.drain(queues=["keyed"]).runs_executed == 4
        # a rate of 3 a minute: the first window's three, then drain would wait a minute
        with worker.create_delivery_worker(concurrency=2):
            wait_until(
                lambda: FlowDb(db, schema).statuses("rated")["completed"] == 3,
                timeout=15,
                what="the rate's three runs",
            )
        assert FlowDb(db, schema).statuses("rated") == Counter(completed=3, queued=2)
    finally:
        producer.close(timeout=10)
        worker.close(timeout=10)
