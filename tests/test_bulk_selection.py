"""Bulk actions on selected runs (run_ids=): retry_runs, cancel_runs and delete_runs act on
the runs an operator ticked (the console's row selection), only those, each as the action by
filter would, with one audit record counting them; bad selections are refused with one line
and change nothing."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from runlane import BulkResult, ConfigurationError, Runlane
from runlane._operator.bulk import MAX_RUN_IDS
from tests.test_bulk import Runs, operator, runs

__all__ = ["operator", "runs"]  # the fixtures, shared with test_bulk


def test_selected_runs_are_acted_on_and_the_others_left(operator: Runlane, runs: Runs) -> None:
    failed = runs.insert(3, "failed")
    queued = runs.insert(2, "queued")
    done = runs.insert(2, "completed")
    # a selection mixing statuses: each action takes the selected runs it applies to
    chosen: list[uuid.UUID | str] = [failed[0], str(failed[1]), queued[0], done[0]]
    assert operator.retry_runs(run_ids=chosen, dry_run=True) == BulkResult(2, 0, dry_run=True)
    assert operator.retry_runs(run_ids=chosen, reason="fixed") == BulkResult(2, 2)
    assert runs.row(failed[0])[0] == "queued"  # type: ignore[index]
    assert runs.row(failed[1])[0] == "queued"  # type: ignore[index]
    assert runs.row(failed[2])[0] == "failed"  # type: ignore[index]
    assert operator.cancel_runs(run_ids=[queued[0], queued[0]]) == BulkResult(1, 1)
    assert runs.row(queued[1])[0] == "queued"  # type: ignore[index]
    assert operator.delete_runs(run_ids=[done[0]]) == BulkResult(1, 1)
    assert runs.row(done[0]) is None
    assert runs.row(done[1]) is not None
    # a selection narrows a filter too
    assert operator.retry_runs(run_ids=[failed[2]], queue="elsewhere") == BulkResult(0, 0)
    records = [r for r in operator.list_audit().items if r.action == "bulk_retry"]
    record = records[-1]
    assert record.runs == 2
    assert record.reason == "fixed"
    assert record.target is not None
    assert record.target.endswith("4 selected runs")
    assert sorted(record.details["run_ids"]) == sorted(str(key) for key in chosen)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([], "run_ids is empty"),
        ("6d3c1b4e-0000-4000-8000-000000000000", "must be a list of run ids"),
        (7, "must be a list of run ids"),
        (["not-a-uuid"], "is not a run id"),
        ([uuid.uuid4() for _ in range(MAX_RUN_IDS + 1)], "more than 1,000"),
    ],
)
def test_bad_selections_are_one_line_and_change_nothing(
    operator: Runlane, runs: Runs, ids: Any, match: str
) -> None:
    runs.insert(2, "failed")
    with pytest.raises(ConfigurationError, match=match) as caught:
        operator.retry_runs(run_ids=ids)
    assert "\n" not in str(caught.value)
    assert len(str(caught.value)) < 300
    assert runs.counts() == {"failed": 2}
    assert not [r for r in operator.list_audit().items if r.action == "bulk_retry"]
