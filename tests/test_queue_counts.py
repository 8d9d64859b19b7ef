"""Per-queue counts tell runs whose handler is executing from runs a worker only claimed
(claimed ahead of a free slot): ``QueueStatus``, ``list_queues()``, ``runlane status``,
``runlane queues list`` (text and ``--json``) and the console's overview and queues pages
(issue 37, item 8). The split is the one ``status()``'s ``claimed_not_started`` makes:
a run is executing once its worker recorded the current attempt's start
(``runs.started_attempt = attempt``)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from runlane import RunContext, Runlane, queue, task
from runlane._operator.status import format_report
from runlane.cli import main
from runlane.web import create_app
from tests.conftest import RunlaneFactory
from tests.helpers import storage_of, wait_until

began, release = threading.Event(), threading.Event()


@task(id="counts.slow", queue="work")
def slow(payload: Any, context: RunContext) -> int:
    began.set()
    release.wait(30)
    return int(payload["n"])


@pytest.fixture
def split(make_runlane: RunlaneFactory) -> Iterator[Runlane]:
    """Queue ``work`` with one run executing (its handler started, on a worker of
    concurrency 1), one claimed ahead by another claimer and one queued; queue ``default``
    empty."""
    began.clear()
    release.clear()
    rl = make_runlane(queues=[queue("default", default=True), queue("work")], tasks=[slow])
    first, second, _third = rl.trigger_many(slow, [{"n": 1}, {"n": 2}, {"n": 3}])
    worker = rl.create_delivery_worker(concurrency=1, queues=["work"])
    try:
        assert began.wait(15)
        (held,) = storage_of(rl).run_claim(rl.environment, ["work"], 1, timedelta(minutes=1))
        assert held.id == second.id
        wait_until(
            lambda: rl.get_run(first.id).executing,
            timeout=10,
            what="the worker to record its handler's start",
        )
        yield rl
    finally:
        release.set()
        worker.close(timeout=10)


def test_status_splits_each_queues_running_runs(split: Runlane) -> None:
    report = split.status()
    (work,) = [q for q in report.queues if q.name == "work"]
    assert (work.queued, work.running, work.claimed) == (1, 1, 1)
    assert work.live_leases == 2
    assert (report.running, report.claimed_not_started) == (2, 1)
    assert sum(q.claimed for q in report.queues) == report.claimed_not_started
    lines = format_report(report)
    header = next(line for line in lines if "leases/limit" in line)
    row = next(line for line in lines if line.strip().startswith("work "))
    cells = dict(zip(header.split(), row.split(), strict=False))
    assert (cells["running"], cells["claimed"], cells["queued"]) == ("1", "1", "1")


def test_list_queues_splits_running_and_keeps_counts_by_status(split: Runlane) -> None:
    (work,) = [q for q in split.list_queues() if q.name == "work"]
    assert (work.running, work.claimed) == (1, 1)
    assert work.counts["running"] == 2  # by status: both hold an attempt
    assert (
        work.running + work.claimed
        == work.counts["running"] + work.counts["cancellation_requested"]
    )
    (idle,) = [q for q in split.list_queues() if q.name == "default"]
    assert (idle.running, idle.claimed) == (0, 0)


def test_a_cancellation_requested_run_counts_as_running(split: Runlane) -> None:
    executing = next(r for r in split.list_runs(status="running").runs if r.executing)
    split.cancel(executing.id)
    (work,) = [q for q in split.list_queues() if q.name == "work"]
    assert (work.running, work.claimed) == (1, 1)
    (status,) = [q for q in split.status().queues if q.name == "work"]
    assert (status.running, status.claimed) == (1, 1)


@pytest.mark.usefixtures("split")
def test_the_cli_queue_tables_split_running_runs(
    database_url: str,
    schema: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("RUNLANE_DATABASE_URL", "RUNLANE_SCHEMA", "RUNLANE_ENVIRONMENT"):
        monkeypatch.delenv(name, raising=False)
    target = ["--database-url", database_url, "--schema", schema]

    capsys.readouterr()
    assert main(["queues", "list", *target]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    (work,) = [row for row in rows if row.startswith("work ")]

    def cell(column: str) -> str:
        return work[header.index(column) :].split("  ", maxsplit=1)[0].strip()

    assert header.index("RUNNING") < header.index("CLAIMED") < header.index("RETRYING")
    assert (cell("QUEUED"), cell("RUNNING"), cell("CLAIMED")) == ("1", "1", "1")

    assert main(["queues", "list", "--json", *target]) == 0
    (listed,) = [q for q in json.loads(capsys.readouterr().out) if q["name"] == "work"]
    assert (listed["running"], listed["claimed"], listed["counts"]["running"]) == (1, 1, 2)

    main(["status", "--json", *target])
    document = json.loads(capsys.readouterr().out)
    (queued,) = [q for q in document["queues"] if q["name"] == "work"]
    assert (queued["running"], queued["claimed"]) == (1, 1)


def test_the_console_splits_running_runs(split: Runlane) -> None:
    client = create_app(split).test_client()
    for path in ("/", "/queues"):
        page = client.get(path).get_data(as_text=True)
        row = re.search(r'<tr data-queue="work">(.*?)</tr>', page, re.S)
        assert row is not None, page
        assert '<td class="running">1</td>' in row.group(1), path
        assert '<td class="claimed">1</td>' in row.group(1), path
    overview = client.get("/").get_data(as_text=True)
    assert re.search(r'id="running"><b>1</b><span>running', overview)
    assert re.search(r'id="claimed"><b>1</b><span>claimed, not started', overview)
