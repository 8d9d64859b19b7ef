"""The trigger path's shortcuts (issue 23): each must give what the long way gives.

A call with default options reuses its task's checked plan; a group's rows are JSON objects
made by the calls themselves (``group_row``) and read by ``json_to_recordset``; payloads
are encoded by one C encoder made once.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import attrs
import pytest

from runlane import ConfigurationError, RunContext, TaskNotFound, task
from runlane._codec import _ENCODER, _encode, dump_json
from runlane._ids import new_run_ids
from runlane._validation import DEFAULT_OPTIONS, TriggerOptions
from runlane.postgres._group import group_row, group_rows
from runlane.storage import InsertedRun, NewRuns
from tests.conftest import RunlaneFactory
from tests.helpers import Conn, run_row, storage_of


@task(id="path.noop")
def noop(payload: Any, context: RunContext) -> None:
    return None


@task(id="path.other", queue="elsewhere")
def other(payload: Any, context: RunContext) -> None:
    return None


def new_runs(**changes: Any) -> NewRuns:
    fields: dict[str, Any] = {
        "environment": "default",
        "task_id": "path.noop",
        "queue": "default",
        "ids": new_run_ids(1),
        "payloads": ['{"a":[1,"ü"]}'],
        "idempotency_keys": [None],
        "priority": 0,
        "max_attempts": 3,
        "delay": timedelta(0),
        "run_at": None,
    }
    fields.update(changes)
    return NewRuns(**fields)


# -- the default plan ------------------------------------------------------------------------


def test_default_options_reuse_the_tasks_plan_and_bad_calls_are_still_refused(
    make_runlane: RunlaneFactory,
) -> None:
    rl = make_runlane(tasks=[noop])
    rl.start()
    first = rl.trigger(noop, {"n": 1})
    plans = rl._triggering
    assert plans.plan(noop, DEFAULT_OPTIONS) is plans.plan(noop, DEFAULT_OPTIONS)
    assert rl.trigger("path.noop", {"n": 2}).task_id == first.task_id == "path.noop"
    assert set(plans._default_plans) == {noop, "path.noop"}
    # refused every time, and never remembered
    for _ in range(2):
        with pytest.raises(TaskNotFound):
            rl.trigger("path.missing", {})
        with pytest.raises(TaskNotFound):
            rl.trigger(other, {})  # not registered here
        with pytest.raises(TaskNotFound):
            rl.trigger(["not", "a", "task"], {})  # type: ignore[arg-type]
    assert set(plans._default_plans) == {noop, "path.noop"}

    @attrs.frozen
    class Named:  # not a Task, but naming a registered task's id
        id: str

    assert rl.trigger(Named("path.noop"), {}).task_id == "path.noop"  # type: ignore[arg-type]
    assert set(plans._default_plans) == {noop, "path.noop"}  # not kept: any object may name it
    # a value equal to a default but of another type takes the checks, not the plan
    with pytest.raises(ConfigurationError, match="priority"):
        rl.trigger(noop, {}, priority=False)
    with pytest.raises(ConfigurationError, match="priority"):
        rl.trigger(noop, {}, priority=0.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="either delay or run_at"):
        rl.trigger(noop, {}, delay=0, run_at=datetime.now(UTC))


def test_trigger_options_are_one_frozen_value() -> None:
    options = TriggerOptions(queue="q", priority=3)
    assert options == TriggerOptions(queue="q", priority=3)
    assert TriggerOptions() == DEFAULT_OPTIONS
    with pytest.raises(AttributeError):
        options.priority = 4  # type: ignore[misc]


# -- a group's rows --------------------------------------------------------------------------


def test_a_group_row_is_json_of_the_calls_run() -> None:
    parent = uuid.uuid4()
    when = datetime(2031, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=-5)))
    runs = new_runs(
        idempotency_keys=['key "quoted" \\ back\nslash ü \u2028'],
        parent_run_id=parent,
        run_at=when,
        delay=timedelta(seconds=1.25),
        priority=-7,
        trace_context='{"traceparent":"00-ab-cd-01"}',
    )
    row = json.loads(group_row(runs))
    assert row == {
        "id": str(runs.ids[0]),
        "e": "default",
        "t": "path.noop",
        "q": "default",
        "p": -7,
        "a": 3,
        "k": 'key "quoted" \\ back\nslash ü \u2028',
        "pr": str(parent),
        "r": when.isoformat(),
        "d": 1.25,
        "c": {"traceparent": "00-ab-cd-01"},
        "payload": {"a": [1, "ü"]},
    }
    plain = json.loads(group_row(new_runs()))
    assert (plain["k"], plain["pr"], plain["r"], plain["c"], plain["d"]) == (
        None,
        None,
        None,
        None,
        0.0,
    )
    assert json.loads(group_rows([group_row(runs), group_row(new_runs())]))[0] == row


def test_the_group_statement_writes_each_rows_fields_as_given(
    make_runlane: RunlaneFactory, db: Conn, schema: str
) -> None:
    """Through the shared statement itself: escaped keys, a run_at in another zone, a
    fractional delay, a parent and a trace context come back from the row as given."""
    rl = make_runlane(tasks=[noop])
    rl.start()
    parent = rl.trigger(noop, {})
    when = datetime(2031, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=-5)))
    odd_key = 'key "quoted" \\ ü \u2028'
    groups = [
        new_runs(idempotency_keys=[odd_key], run_at=when, priority=5),
        new_runs(delay=timedelta(seconds=90.5), parent_run_id=parent.id),
        new_runs(trace_context='{"traceparent":"00-ab-cd-01"}', payloads=['"ü\\u00e9"']),
    ]
    handles = storage_of(rl)._runs.insert_together(groups)  # type: ignore[attr-defined]
    assert handles == [[InsertedRun(g.ids[0], "default", True)] for g in groups]
    first, second, third = (run_row(db, schema, g.ids[0]) for g in groups)
    assert (first["idempotency_key"], first["due_at"], first["priority"]) == (odd_key, when, 5)
    assert first["payload"] == {"a": [1, "ü"]}
    assert second["parent_run_id"] == parent.id
    ahead = second["due_at"] - second["created_at"]
    assert timedelta(seconds=90) < ahead <= timedelta(seconds=91)
    assert third["trace_context"] == {"traceparent": "00-ab-cd-01"}
    assert third["payload"] == "üé"
    # the key resolves to its run when triggered again
    again = rl.trigger(noop, {"a": [1, "ü"]}, idempotency_key=odd_key)
    assert (again.id, again.created) == (groups[0].ids[0], False)


# -- the encoder -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        {"order": 1},
        [1.5, -0.0, 1e300, "é\u2028", None, True, False, {"k": []}],
        "text",
        12345678901234567890,
        {"nested": {"deep": [[{"x": "y"}]]}},
    ],
)
def test_the_encoder_made_once_writes_what_json_encoder_writes(value: Any) -> None:
    assert _encode(value) == _ENCODER.encode(value) == dump_json(value)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (float("nan"), ValueError),
        ({"a": object()}, TypeError),
        (10**5000, ValueError),
    ],
    ids=["nan", "object", "huge-int"],
)
def test_the_encoder_made_once_refuses_what_json_encoder_refuses(
    value: Any, error: type[Exception]
) -> None:
    with pytest.raises(error) as ours:
        _encode(value)
    with pytest.raises(error) as theirs:
        _ENCODER.encode(value)
    assert str(ours.value) == str(theirs.value)
