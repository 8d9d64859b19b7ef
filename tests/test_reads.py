"""Concurrent point reads (``get_run``) share queries."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial

import pytest

from runlane import RunContext, RunNotFound, RunSnapshot, task
from runlane.runtime._reads import PointReads
from tests.conftest import RunlaneFactory
from tests.helpers import run_together


def test_callers_arriving_during_a_read_share_the_next_one() -> None:
    entered = threading.Event()
    release = threading.Event()
    seen: list[list[int]] = []

    def fetch_many(keys: Sequence[int]) -> dict[int, str]:
        seen.append(sorted(keys))
        if len(seen) == 1:
            entered.set()
            assert release.wait(10)
        return {k: f"v{k}" for k in keys if k != 99}

    reads: PointReads[int, str] = PointReads(fetch_many)
    results: dict[int, str | None] = {}

    def get(key: int) -> None:
        results[key] = reads.get(key)

    first = threading.Thread(target=get, args=(0,))
    first.start()
    assert entered.wait(10)  # the leader is inside its read
    others = [threading.Thread(target=get, args=(k,)) for k in (1, 2, 3, 99)]
    for thread in others:
        thread.start()
    # the four queue behind the leader; let the leader finish once all have queued
    for _ in range(500):
        with reads._lock:
            if sum(len(w) for w in reads._pending.values()) == 4:
                break
        threading.Event().wait(0.01)
    release.set()
    for thread in [first, *others]:
        thread.join(10)
        assert not thread.is_alive()
    assert seen == [[0], [1, 2, 3, 99]]
    assert reads.queries == 2
    assert results == {0: "v0", 1: "v1", 2: "v2", 3: "v3", 99: None}


def test_a_failed_read_reaches_every_caller_of_its_batch() -> None:
    def fetch_many(keys: Sequence[int]) -> dict[int, str]:
        raise RuntimeError("database down")

    reads: PointReads[int, str] = PointReads(fetch_many)
    with pytest.raises(RuntimeError, match="database down"):
        reads.get(1)
    with pytest.raises(RuntimeError, match="database down"):
        reads.get(2)  # the batcher is usable again after a failure


def test_concurrent_get_run_is_batched_and_correct(make_runlane: RunlaneFactory) -> None:
    @task(id="reads.noop")
    def noop(payload: dict[str, int], context: RunContext) -> None:
        return None

    runlane = make_runlane(tasks=[noop])
    handles = runlane.trigger_many(noop, [{"i": i} for i in range(32)])
    runlane.get_run(handles[0].id)  # warm up: connect and check the schema
    before = runlane._rooms.reads.point_reads.queries
    jobs: list[Callable[[], RunSnapshot]] = [partial(runlane.get_run, h.id) for h in handles]
    snapshots = run_together(jobs)
    assert [s.payload for s in snapshots] == [{"i": i} for i in range(32)]
    assert [s.id for s in snapshots] == [h.id for h in handles]
    assert runlane._rooms.reads.point_reads.queries - before < 32  # some reads were shared
    with pytest.raises(RunNotFound):
        runlane.get_run("01a22a69-2de7-71c4-861d-0feb3b665cda")
