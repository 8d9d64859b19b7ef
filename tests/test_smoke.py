from __future__ import annotations

from runlane import RunContext, RunStatus, task
from tests.conftest import RunlaneFactory
from tests.helpers import Greet


@task(id="greet", schema=Greet)
def greet(payload: Greet, context: RunContext) -> dict[str, str]:
    return {"greeting": f"hello {payload.name}", "attempt": str(context.attempt)}


def test_trigger_drain_result(make_runlane: RunlaneFactory) -> None:
    runlane = make_runlane(tasks=[greet])
    handle = runlane.trigger(greet, Greet(name="ada"))
    assert runlane.get_run(handle.id).status is RunStatus.QUEUED
    result = runlane.drain()
    assert result.runs_executed == 1
    snap = runlane.get_run(handle.id)
    assert snap.status is RunStatus.COMPLETED
    assert snap.output == {"greeting": "hello ada", "attempt": "1"}
    assert snap.payload == {"name": "ada"}
    assert snap.attempt == 1
