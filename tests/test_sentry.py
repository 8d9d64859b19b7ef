"""Real sentry-sdk, a transport keeping events in memory: examples/sentry's final failures
reach Sentry with their traceback and runlane's fields as tags, retried ones as breadcrumbs,
and sentry_scope keeps concurrent runs' (and one thread's successive runs') scopes apart."""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from runlane import NonRetryableError, RunContext, Runlane, RunStatus, task
from tests._optional import require
from tests.conftest import RunlaneFactory

sentry_sdk = require("sentry_sdk", "sentry-sdk")
from sentry_sdk.envelope import Envelope  # noqa: E402
from sentry_sdk.transport import Transport  # noqa: E402

from runlane.integrations.sentry import sentry_scope  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sentry"


class Memory(Transport):
    """Keeps every event Sentry would send."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def capture_envelope(self, envelope: Envelope) -> None:
        event = envelope.get_event()
        if event is not None:
            with self._lock:
                self.events.append(dict(event))


@pytest.fixture
def sentry() -> Iterator[Memory]:
    memory = Memory()
    sentry_sdk.init(
        dsn="https://public@sentry.invalid/1",
        transport=memory,
        auto_enabling_integrations=False,
        default_integrations=True,  # the logging integration among them
        traces_sample_rate=None,
    )
    try:
        yield memory
    finally:
        sentry_sdk.get_client().close()
        sentry_sdk.get_global_scope().set_client(None)


@pytest.fixture
def billing(database_url: str, schema: str) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RUNLANE_SCHEMA", schema)
        patch.syspath_prepend(str(EXAMPLE))
        module = importlib.import_module("billing")
        try:
            yield module
        finally:
            del sys.modules["billing"]


def by_run(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {e["tags"]["runlane.run_id"]: e for e in events if "runlane.run_id" in e["tags"]}


def test_a_final_failure_reaches_sentry_with_its_traceback_and_tags(
    sentry: Memory, billing: Any, database_url: str
) -> None:
    rl: Runlane = billing.make_runlane(database_url)
    try:
        retried = rl.trigger(billing.send_invoice, {"customer": "flaky", "amount_cents": 5})
        failed = rl.trigger(billing.send_invoice, {"customer": "ada", "amount_cents": 0})
        done = rl.trigger(billing.send_invoice, {"customer": "bob", "amount_cents": 7})
        result = rl.drain()
        assert (result.completed, result.retried, result.failed) == (1, 1, 1)
    finally:
        rl.close()
    sentry_sdk.flush()
    events = by_run(sentry.events)
    assert set(events) == {str(failed.id)}, "one event: the final failure only"
    event = events[str(failed.id)]
    assert event["level"] == "error"
    assert event["logger"] == "runlane.worker"
    assert event["tags"] == {
        "runlane.run_id": str(failed.id),
        "runlane.task_id": "billing.send_invoice",
        "runlane.queue": "default",
        "runlane.attempt": "1",
        "runlane.environment": "default",
        "customer": "ada",
    }
    (exception,) = event["exception"]["values"]
    assert exception["type"] == "NonRetryableError"
    assert exception["value"] == "an invoice of 0 cents cannot be sent"
    frames = exception["stacktrace"]["frames"]
    assert frames[-1]["function"] == "send_invoice"
    assert frames[-1]["filename"].endswith("billing.py")
    assert event["contexts"]["runlane"]["run_id"] == str(failed.id)
    assert event["extra"]["outcome"] == "failed"
    # the retried attempt was a breadcrumb of its own scope, not of the failed run's
    crumbs = [c.get("message", "") for c in event.get("breadcrumbs", {}).get("values", [])]
    assert not any(str(retried.id) in c for c in crumbs)
    assert not any(str(done.id) in c for c in crumbs)


@attrs.frozen
class Customer:
    name: str
    together: bool


_barrier = threading.Barrier(2, timeout=20)


@task(id="sentry.customer", schema=Customer)
def customer_job(payload: Customer, context: RunContext) -> None:
    if payload.together:
        sentry_sdk.set_tag("customer", payload.name)
        sentry_sdk.add_breadcrumb(message=f"looked up {payload.name}")
        _barrier.wait()  # both runs hold their scope at once, in two worker threads
    raise NonRetryableError(f"customer {payload.name} failed")


def test_sentry_scope_isolates_concurrent_runs_in_threads(
    sentry: Memory, make_runlane: RunlaneFactory
) -> None:
    rl = make_runlane(tasks=[customer_job], middleware=[sentry_scope])
    # a record outside any attempt (the application's own, or the worker's) is no run's
    sentry_sdk.add_breadcrumb(message="outside any run")
    first = rl.trigger(customer_job, {"name": "ada", "together": True})
    second = rl.trigger(customer_job, {"name": "bob", "together": True})
    with rl.create_delivery_worker(concurrency=2):
        for handle in (first, second):
            assert rl.wait_for_run(handle.id, timeout=30).status is RunStatus.FAILED
        # then runs setting nothing, on the same two threads
        later = [rl.trigger(customer_job, {"name": f"c{i}", "together": False}) for i in range(4)]
        for handle in later:
            assert rl.wait_for_run(handle.id, timeout=30).status is RunStatus.FAILED
    sentry_sdk.flush()
    events = by_run(sentry.events)
    assert set(events) == {str(h.id) for h in (first, second, *later)}
    for handle, name in ((first, "ada"), (second, "bob")):
        event = events[str(handle.id)]
        assert event["tags"]["customer"] == name
        assert event["tags"]["runlane.task_id"] == "sentry.customer"
        crumbs = [c.get("message") for c in event["breadcrumbs"]["values"]]
        assert f"looked up {name}" in crumbs
        other = "bob" if name == "ada" else "ada"
        assert f"looked up {other}" not in crumbs
        assert "outside any run" not in crumbs
    for handle in later:
        event = events[str(handle.id)]
        assert "customer" not in event["tags"], "a tag leaked from an earlier run's scope"
        assert not any(
            "looked up" in (c.get("message") or "") for c in event["breadcrumbs"]["values"]
        )
