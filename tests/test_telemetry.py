"""OpenTelemetry: trigger and attempt spans share a trace through the stored context;
counters, histograms and the queue-depth gauge; nothing breaks without a provider."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import attrs
import psycopg
import pytest
from opentelemetry import metrics, trace
from opentelemetry.metrics import _internal as metrics_internal
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from opentelemetry.util._once import Once

from runlane import NonRetryableError, RetryPolicy, RunContext, RunStatus, Task, task
from runlane._telemetry import instruments, tracing_enabled
from tests.conftest import RunlaneFactory
from tests.helpers import q


@attrs.frozen
class Job:
    n: int


def _reset_globals() -> None:
    """Unset the global providers (the API sets them once per process; its tests reset
    them this way too)."""
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    metrics_internal._METER_PROVIDER_SET_ONCE = Once()
    metrics_internal._METER_PROVIDER = None


@attrs.define
class Otel:
    spans: InMemorySpanExporter
    reader: InMemoryMetricReader

    def finished(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name == name]

    def metric_points(self) -> dict[str, list[Any]]:
        data = self.reader.get_metrics_data()
        points: dict[str, list[Any]] = {}
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    points.setdefault(metric.name, []).extend(metric.data.data_points)
        return points

    def total(self, name: str, **attributes: Any) -> float:
        return float(
            sum(
                p.value
                for p in self.metric_points().get(name, [])
                if all(p.attributes.get(k) == v for k, v in attributes.items())
            )
        )


@contextmanager
def _providers_set() -> Iterator[Otel]:
    """SDK tracer and meter providers set globally (in-memory exporters) for the block."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(meters)
    try:
        yield Otel(exporter, reader)
    finally:
        meters.shutdown()
        provider.shutdown()
        _reset_globals()


@pytest.fixture
def otel() -> Iterator[Otel]:
    _reset_globals()
    with _providers_set() as otel:
        yield otel


def job_task(*, fail: type[Exception] | None = None, **options: Any) -> Task[Job, int]:
    @task(id="job", schema=Job, **options)
    def job(payload: Job, context: RunContext) -> int:
        if fail is not None:
            raise fail(f"job {payload.n} failed")
        return payload.n

    return job


def test_attempt_span_continues_the_trigger_trace(
    otel: Otel, make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    producer = make_runlane(tasks=[job_task()])
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("request") as request:
        handle = producer.trigger("job", {"n": 1})
    stored = db.execute(
        q("select trace_context from {s}.runs where id = %s", schema), (handle.id,)
    ).fetchone()
    assert stored is not None
    assert "traceparent" in stored[0]

    # another runtime (as another process would) runs the attempt
    consumer = make_runlane(tasks=[job_task()])
    assert consumer.drain().completed == 1

    (trigger_span,) = otel.finished("runlane.trigger")
    (run_span,) = otel.finished("runlane.run")
    request_ctx = request.get_span_context()
    assert trigger_span.parent is not None
    assert trigger_span.parent.span_id == request_ctx.span_id
    assert trigger_span.attributes is not None
    assert trigger_span.attributes["runlane.task_id"] == "job"
    assert trigger_span.attributes["runlane.queue"] == "default"
    assert trigger_span.attributes["runlane.run_count"] == 1
    assert run_span.context is not None
    assert trigger_span.context is not None
    assert run_span.context.trace_id == request_ctx.trace_id
    assert run_span.parent is not None
    assert run_span.parent.span_id == trigger_span.context.span_id
    assert run_span.attributes is not None
    assert run_span.attributes["runlane.run_id"] == str(handle.id)
    assert run_span.attributes["runlane.attempt"] == 1
    assert run_span.attributes["runlane.queue"] == "default"
    assert run_span.status.status_code is not StatusCode.ERROR


def test_child_runs_continue_the_attempt_trace(otel: Otel, make_runlane: RunlaneFactory) -> None:
    @task(id="leaf", schema=Job)
    def leaf(payload: Job, context: RunContext) -> int:
        return payload.n

    @task(id="root", schema=Job)
    def root(payload: Job, context: RunContext) -> None:
        context.trigger_child(leaf, {"n": payload.n})

    rl = make_runlane(tasks=[leaf, root])
    rl.trigger_many("root", [{"n": 1}])
    rl.drain()
    runs = {s.attributes["runlane.task_id"]: s for s in otel.finished("runlane.run")}  # type: ignore[index]
    assert set(runs) == {"root", "leaf"}
    trace_ids = {s.context.trace_id for s in otel.spans.get_finished_spans() if s.context}
    assert len(trace_ids) == 1


def test_failed_attempt_span_has_error_status(otel: Otel, make_runlane: RunlaneFactory) -> None:
    rl = make_runlane(tasks=[job_task(fail=NonRetryableError)])
    handle = rl.trigger("job", {"n": 2})
    result = rl.drain()
    assert (result.completed, result.failed, result.retried) == (0, 1, 0)
    assert rl.get_run(handle.id).status is RunStatus.FAILED
    (run_span,) = otel.finished("runlane.run")
    assert run_span.status.status_code is StatusCode.ERROR
    assert "job 2 failed" in (run_span.status.description or "")


def test_counters_histograms_and_queue_depth(otel: Otel, make_runlane: RunlaneFactory) -> None:
    ok = make_runlane(tasks=[job_task()])
    ok.trigger_many("job", [{"n": i} for i in range(3)])
    assert otel.total("runlane.runs.triggered", **{"runlane.task_id": "job"}) == 3
    # the gauge reads status() of open runtimes when the reader collects
    depth = otel.total(
        "runlane.queue.depth", **{"runlane.queue": "default", "runlane.status": "queued"}
    )
    assert depth == 3
    ok.drain()
    assert otel.total("runlane.runs.started") == 3
    assert otel.total("runlane.runs.completed") == 3
    points = otel.metric_points()
    assert sum(p.count for p in points["runlane.attempt.duration"]) == 3
    assert sum(p.count for p in points["runlane.run.start_delay"]) == 3
    assert min(p.min for p in points["runlane.run.start_delay"]) >= 0

    retrying = make_runlane(tasks=[job_task(fail=ValueError, retry=RetryPolicy(max_attempts=2))])
    retrying.trigger("job", {"n": 9})
    assert retrying.drain().retried == 1
    assert otel.total("runlane.runs.retried") == 1
    assert otel.total("runlane.runs.failed") == 0


def test_a_stored_trace_context_propagation_cannot_read_starts_a_new_trace(
    make_runlane: RunlaneFactory,
    otel: Otel,
    db: psycopg.Connection[Any],
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    rl = make_runlane(tasks=[job_task()])
    handle = rl.trigger("job", {"n": 1})
    # written by another producer, or by hand: it used to stop the worker that took it
    db.execute(
        q("update {s}.runs set trace_context = '{{\"traceparent\": 1}}' where id = %s", schema),
        (handle.id,),
    )
    worker = rl.create_delivery_worker(concurrency=1)
    assert rl.wait_for_run(handle.id, timeout=15).status is RunStatus.COMPLETED
    assert not worker.closed
    worker.close(timeout=10)
    assert any("trace context propagation cannot read" in r.getMessage() for r in caplog.records)


def test_without_a_provider_nothing_is_traced_or_stored(
    make_runlane: RunlaneFactory, db: psycopg.Connection[Any], schema: str
) -> None:
    _reset_globals()
    assert not tracing_enabled()
    assert instruments() is None
    rl = make_runlane(tasks=[job_task()])
    with trace.get_tracer("test").start_as_current_span("request"):
        handle = rl.trigger("job", {"n": 1}, delay=timedelta(0))
    stored = db.execute(
        q("select trace_context from {s}.runs where id = %s", schema), (handle.id,)
    ).fetchone()
    assert stored == (None,)
    assert rl.drain().completed == 1


def test_a_provider_set_after_the_runtime_started_is_used(make_runlane: RunlaneFactory) -> None:
    """The unset check reads the API's module globals (its getters look the environment up
    on every call); a provider set later is seen at the next trigger and attempt. If a
    later OpenTelemetry renames those globals, the check falls back to the getters."""
    assert hasattr(trace, "_TRACER_PROVIDER")
    assert hasattr(metrics_internal, "_METER_PROVIDER")
    _reset_globals()
    rl = make_runlane(tasks=[job_task()])
    rl.trigger("job", {"n": 1})
    assert rl.drain().completed == 1
    with _providers_set() as otel:
        assert tracing_enabled()
        assert instruments() is not None
        rl.trigger("job", {"n": 2})
        assert rl.drain().completed == 1
        names = sorted(s.name for s in otel.spans.get_finished_spans())
        assert names == ["runlane.run", "runlane.trigger"]
        assert otel.total("runlane.runs.triggered") == 1
        assert otel.total("runlane.runs.completed") == 1
