"""examples/otel/worker.py: `runlane worker otel.worker:runlane` with the OpenTelemetry SDK
set up in the APP's module exports the attempt's span and runlane's metrics; the docs show
the file verbatim."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

from runlane import RunContext, RunStatus, create_runlane, queue, task
from runlane.postgres import postgres_polling_lane
from tests.helpers import process

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "otel" / "worker.py"

pytest.importorskip("opentelemetry.sdk", reason="the dev extra installs opentelemetry-sdk")


@attrs.frozen
class SendEmail:
    to: str
    subject: str


@task(id="email.send", schema=SendEmail, queue="email")
def send_email(payload: SendEmail, context: RunContext) -> None:
    raise AssertionError("runs in the example's worker only")


def test_the_docs_show_the_example_verbatim() -> None:
    page = (ROOT / "docs" / "observability.md").read_text()
    assert f"```python\n{EXAMPLE.read_text()}```" in page


def documents(text: str) -> list[dict[str, Any]]:
    """The JSON documents the console exporters wrote, one after another."""
    decoder = json.JSONDecoder()
    found: list[dict[str, Any]] = []
    at = 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return found
        document, at = decoder.raw_decode(text, at)
        found.append(document)


def metric_points(exported: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    points: dict[str, list[dict[str, Any]]] = {}
    for document in exported:
        for resource in document.get("resource_metrics", []):
            for scope in resource["scope_metrics"]:
                for metric in scope["metrics"]:
                    points.setdefault(metric["name"], []).extend(metric["data"]["data_points"])
    return points


def test_worker_app_with_the_sdk_exports_spans_and_metrics(database_url: str, schema: str) -> None:
    producer = create_runlane(
        lane=postgres_polling_lane(connection_string=database_url, schema=schema),
        queues=[queue("email", default=True), queue("reports")],
        tasks=[send_email],
    )
    env = {**os.environ, "DATABASE_URL": database_url, "RUNLANE_SCHEMA": schema}
    argv = [sys.executable, "-m", "runlane.cli", "worker", "otel.worker:runlane"]
    try:
        with process(argv, cwd=EXAMPLE.parent.parent, env=env, stdout=subprocess.PIPE) as proc:
            assert proc.stderr is not None
            # the start line, after the listener's (the two threads log in either order)
            seen = [proc.stderr.readline() for _ in range(2)]
            assert any("running 4 slots" in line for line in seen), seen
            handle = producer.trigger(send_email, {"to": "ada@example.com", "subject": "hi"})
            run = producer.wait_for_run(handle.id, timeout=30)
            assert run.status is RunStatus.COMPLETED
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        producer.close()

    exported = documents(out)
    spans = [d for d in exported if "context" in d and "name" in d]
    (attempt,) = [s for s in spans if s["name"] == "runlane.run"]
    assert attempt["attributes"]["runlane.run_id"] == str(handle.id)
    assert attempt["attributes"]["runlane.task_id"] == "email.send"
    assert attempt["attributes"]["runlane.outcome"] == "completed"
    assert attempt["resource"]["attributes"]["service.name"] == "quickstart-worker"

    points = metric_points(exported)
    for counter in ("runlane.runs.started", "runlane.runs.completed"):
        assert sum(p["value"] for p in points[counter]) == 1, (counter, points[counter])
    (duration,) = points["runlane.attempt.duration"]
    assert duration["count"] == 1
    assert duration["attributes"]["runlane.task_id"] == "email.send"
