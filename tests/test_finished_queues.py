"""A queue whose runs have all finished is listed (issue 39): ``list_queues()``, ``runlane
queues list`` (text and ``--json``) and the console's queues page read one rule, the
queues repository's ``queue_list``: the queues with unfinished runs or a pause row, and the
queues of the newest ``RECENT_FINISHED`` finished runs (a bounded walk of runs_finished;
pruned runs are not read), with every count 0."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from runlane import RunContext, Runlane, queue, task
from runlane.cli import main
from runlane.models import RunStatus
from runlane.postgres import _queues
from runlane.web import create_app
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, SchemaDb

QUEUES = [queue("default", default=True), queue("mail")]


@task(id="finished.send", queue="mail")
def send(payload: Any, context: RunContext) -> None:
    return None


def _finished(make_runlane: RunlaneFactory) -> tuple[Runlane, Runlane]:
    """An app whose one run of queue ``mail`` completed, and a runtime that defines
    nothing (``runlane web --database-url``) on the same schema."""
    app = make_runlane(queues=QUEUES, tasks=[send])
    handle = app.trigger(send, {})
    assert app.drain().completed == 1
    assert app.get_run(handle.id).status is RunStatus.COMPLETED
    return app, make_runlane()


def _insert_finished(db: Conn, schema: str, queue_name: str, *, pruned: bool = False) -> None:
    SchemaDb(db, schema).run(
        "insert into {schema}.runs (id, environment, task_id, queue, status, payload, "
        "max_attempts, due_at, started_at, finished_at, pruned_at, remaining_children) "
        "values (gen_random_uuid(), 'default', 'old.task', %s, 'completed', "
        "jsonb_build_object(), 1, now(), now(), now(), "
        "case when %s then now() end, case when %s then 0 end)",
        queue_name,
        pruned,
        pruned,
    )


def test_list_queues_lists_a_queue_whose_runs_all_finished(
    make_runlane: RunlaneFactory,
) -> None:
    app, bare = _finished(make_runlane)
    (mail,) = [q for q in bare.list_queues() if q.name == "mail"]
    assert not mail.defined
    assert (mail.paused, mail.paused_at, mail.paused_reason) == (False, None, None)
    assert set(mail.counts.values()) == {0}
    assert set(mail.counts) == {s.value for s in RunStatus if not s.is_terminal}
    assert (mail.running, mail.claimed, mail.oldest_queued_age) == (0, 0, None)
    assert [q.name for q in app.list_queues()] == ["default", "mail"]
    assert [q.defined for q in app.list_queues()] == [True, True]  # listed once, as defined
    assert app.pause_queue("mail")  # a pause row and finished runs: one entry, paused
    (paused,) = [q for q in bare.list_queues() if q.name == "mail"]
    assert paused.paused


def test_the_cli_lists_a_queue_whose_runs_all_finished(
    *,
    make_runlane: RunlaneFactory,
    cli_target: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    _finished(make_runlane)
    capsys.readouterr()
    assert main(["queues", "list", *cli_target]) == 0
    _header, *rows = capsys.readouterr().out.splitlines()
    assert any(row.startswith("mail * ") for row in rows), rows
    assert main(["queues", "list", "--json", *cli_target]) == 0
    (mail,) = [q for q in json.loads(capsys.readouterr().out) if q["name"] == "mail"]
    assert (mail["defined"], mail["paused"], mail["counts"]["queued"]) == (False, False, 0)


def test_the_console_lists_what_list_queues_lists(make_runlane: RunlaneFactory) -> None:
    _app, bare = _finished(make_runlane)
    page = create_app(bare).test_client().get("/queues").get_data(as_text=True)
    listed = re.findall(r'<tr data-queue="([^"]+)">', page)
    assert listed == [q.name for q in bare.list_queues()] == ["default", "mail"]


def test_only_the_newest_finished_runs_are_read_and_pruned_ones_not(
    make_runlane: RunlaneFactory, db: Conn, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare = make_runlane()
    _insert_finished(db, schema, "older")
    _insert_finished(db, schema, "newer")
    _insert_finished(db, schema, "gone", pruned=True)
    assert {"older", "newer"} <= {q.name for q in bare.list_queues()}
    assert "gone" not in {q.name for q in bare.list_queues()}
    SchemaDb(db, schema).run(
        "update {schema}.runs set finished_at = finished_at - interval '1 hour' "
        "where queue = 'older'"
    )
    monkeypatch.setattr(_queues, "RECENT_FINISHED", 1)
    names = {q.name for q in bare.list_queues()}
    assert ("newer" in names, "older" in names) == (True, False)
