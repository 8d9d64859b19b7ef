"""Run logs, OpenTelemetry spans and metrics; each costs nothing when it is off.

Logs: ``runlane.runs`` records each attempt's start and end at INFO with ``extra`` fields
(failed ends go to ``runlane.worker`` instead, see ``worker._failure_log``). Tracing and
metrics need ``opentelemetry-api`` (the ``otel`` extra) and a provider set globally; the
trace context is stored with the runs so each attempt's ``runlane.run`` span has the
trigger as its parent, whatever process runs it. Names and fields: docs/observability.md.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from runlane.errors import StopReason
from runlane.models import QueueStatus, StatusReport
from runlane.storage import ClaimedRun, Completion, Failure, InsertedRun, LeaseRef, NewRuns

if TYPE_CHECKING:
    from runlane.tasks import Queue

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics as otel_metrics
    from opentelemetry import propagate as otel_propagate
    from opentelemetry import trace as otel_trace
except ImportError:  # pragma: no cover - the otel extra is not installed
    otel_trace = None  # type: ignore[assignment]

try:  # the unset global meter provider (a proxy); private, so guarded
    from opentelemetry.metrics import _internal as _otel_metrics_internal
    from opentelemetry.metrics._internal import _ProxyMeterProvider as _UNSET_METERS
except ImportError:  # pragma: no cover
    _UNSET_METERS = ()  # type: ignore[assignment,misc]
    _otel_metrics_internal = None  # type: ignore[assignment]

# Until a global provider is set, OpenTelemetry's getters look the environment up on every
# call (for a provider named there), which cost more than the rest of the check on each
# trigger and attempt. Their module globals (private, so read guarded) say at once that no
# provider is set; the getters then run only when one is, or when the environment names one.
_UNREAD = object()
_ENV_TRACER = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
_ENV_METERS = "OTEL_PYTHON_METER_PROVIDER" in os.environ

__all__ = [
    "Attempt",
    "begin_attempt",
    "handed_back",
    "outcome_kind",
    "queue_statuses",
    "register_runtime",
    "trigger",
    "unregister_runtime",
]

log = logging.getLogger("runlane.runs")

_INFO = logging.INFO
_VERSION = "0"

# -- status --------------------------------------------------------------------------------


def queue_statuses(
    rows: Iterable[Mapping[str, Any]], queues: Mapping[str, Queue]
) -> tuple[QueueStatus, ...]:
    """Per-queue counts: every registered queue (zeros when it has no runs) and any other
    queue that has runs, by name."""
    seen = {str(row["queue"]): row for row in rows}
    names = sorted(set(seen) | set(queues))
    result = []
    for name in names:
        row = seen.get(name, {})
        limit = queues[name].concurrency_limit if name in queues else None
        result.append(
            QueueStatus(
                name=name,
                queued=int(row.get("queued", 0)),
                running=int(row.get("running", 0)),
                claimed=int(row.get("claimed", 0)),
                retrying=int(row.get("retrying", 0)),
                waiting=int(row.get("waiting", 0)),
                live_leases=int(row.get("live_leases", 0)),
                concurrency_limit=limit,
                paused=bool(row.get("paused", False)),
            )
        )
    return tuple(result)


# -- providers -----------------------------------------------------------------------------


def tracing_enabled() -> bool:
    """A tracer provider other than the API's default proxy (or a no-op) is set."""
    if otel_trace is None:
        return False
    if getattr(otel_trace, "_TRACER_PROVIDER", _UNREAD) is None and not _ENV_TRACER:
        return False
    provider = otel_trace.get_tracer_provider()
    return not isinstance(provider, otel_trace.ProxyTracerProvider | otel_trace.NoOpTracerProvider)


def _tracer() -> Any:
    return otel_trace.get_tracer("runlane", _VERSION)


class _Instruments:
    def __init__(self, provider: Any) -> None:
        meter = provider.get_meter("runlane", _VERSION)
        run = "{run}"
        self.triggered = meter.create_counter("runlane.runs.triggered", run, "runs triggered")
        self.started = meter.create_counter("runlane.runs.started", run, "attempts started")
        self.completed = meter.create_counter("runlane.runs.completed", run, "runs completed")
        self.failed = meter.create_counter("runlane.runs.failed", run, "runs failed for good")
        self.retried = meter.create_counter(
            "runlane.runs.retried", run, "failed attempts scheduled to retry"
        )
        self.handed_back = meter.create_counter(
            "runlane.runs.handed_back", run, "attempts handed back unspent"
        )
        self.cancelled = meter.create_counter(
            "runlane.runs.cancelled", run, "runs cancelled while running"
        )
        self.duration = meter.create_histogram(
            "runlane.attempt.duration", "s", "how long handlers ran"
        )
        self.start_delay = meter.create_histogram(
            "runlane.run.start_delay", "s", "from a run's due time to its attempt's start"
        )
        meter.create_observable_gauge(
            "runlane.queue.depth", [_observe_queues], run, "runs per queue and status"
        )


_meters_lock = threading.Lock()
_meters: list[tuple[Any, _Instruments]] = []  # the provider last seen, and its instruments


def instruments() -> _Instruments | None:
    """The instruments of the global meter provider, or None when none is set."""
    if otel_trace is None:
        return None
    if getattr(_otel_metrics_internal, "_METER_PROVIDER", _UNREAD) is None and not _ENV_METERS:
        return None
    provider = otel_metrics.get_meter_provider()
    cached = _meters[-1] if _meters else None
    if cached is not None and cached[0] is provider:
        return cached[1]
    if isinstance(provider, _UNSET_METERS | otel_metrics.NoOpMeterProvider):
        return None
    with _meters_lock:
        if not _meters or _meters[-1][0] is not provider:
            _meters[:] = [(provider, _Instruments(provider))]
        return _meters[-1][1]


class StatusSource(Protocol):
    """An open runtime, as the queue-depth gauge reads it."""

    def status(self) -> StatusReport: ...


_runtimes: weakref.WeakSet[StatusSource] = weakref.WeakSet()


def register_runtime(runtime: StatusSource) -> None:
    """Report this runtime's queue depths through ``runlane.queue.depth`` (from its start
    until :func:`unregister_runtime`, at its close)."""
    _runtimes.add(runtime)


def unregister_runtime(runtime: StatusSource) -> None:
    """Stop reading this runtime's queue depths (it is closing)."""
    _runtimes.discard(runtime)


def _observe_queues(options: Any) -> Iterator[Any]:
    for runtime in list(_runtimes):
        try:
            report = runtime.status()
        except Exception:
            log.debug("runlane: queue depth of %r not read", runtime, exc_info=True)
            continue
        for q in report.queues:
            for status in ("queued", "running", "retrying", "waiting"):
                yield otel_metrics.Observation(
                    getattr(q, status),
                    {
                        "runlane.environment": report.environment,
                        "runlane.queue": q.name,
                        "runlane.status": status,
                    },
                )


# -- triggers ------------------------------------------------------------------------------


def trigger(runs: NewRuns, insert: Callable[[NewRuns], list[InsertedRun]]) -> list[InsertedRun]:
    """Insert ``runs`` inside a ``runlane.trigger`` span whose context they store."""
    if not tracing_enabled():
        inserted = insert(runs)
    else:
        attributes = {
            "runlane.task_id": runs.task_id,
            "runlane.queue": runs.queue,
            "runlane.run_count": len(runs.ids),
            "runlane.environment": runs.environment,
        }
        if len(runs.ids) == 1:
            attributes["runlane.run_id"] = str(runs.ids[0])
        with _tracer().start_as_current_span(
            "runlane.trigger", kind=otel_trace.SpanKind.PRODUCER, attributes=attributes
        ) as span:
            carrier: dict[str, str] = {}
            otel_propagate.inject(carrier)
            if carrier:
                runs = attrs.evolve(runs, trace_context=json.dumps(carrier))
            inserted = insert(runs)
            span.set_attribute("runlane.created_count", sum(r.created for r in inserted))
    meters = instruments()
    if meters is not None:
        created = sum(r.created for r in inserted)
        if created:
            meters.triggered.add(
                created, {"runlane.task_id": runs.task_id, "runlane.queue": runs.queue}
            )
    return inserted


# -- attempts ------------------------------------------------------------------------------

COMPLETED = "completed"
RETRIED = "retried"
FAILED = "failed"
HANDED_BACK = "handed_back"
CANCELLED = "cancelled"
SUSPENDED = "suspended"
TIMED_OUT = "timed_out"
LEASE_LOST = "lease_lost"
DISCARDED = "discarded"  # finished after close handed the run back: its result is dropped


def outcome_kind(write: Completion | Failure | LeaseRef | None, reason: StopReason | None) -> str:
    """What an attempt's outcome means (the write that ends it, the stop asked of it):
    completed, retried, failed, handed_back, cancelled, suspended, timed_out or lease_lost."""
    if isinstance(write, Completion):
        return COMPLETED
    if isinstance(write, Failure):
        return FAILED if write.retry_delay is None else RETRIED
    if isinstance(write, LeaseRef):
        return CANCELLED if reason is StopReason.CANCEL_REQUESTED else HANDED_BACK
    if reason is StopReason.TIMEOUT:
        return TIMED_OUT
    if reason is StopReason.LEASE_LOST:
        return LEASE_LOST
    return SUSPENDED


def _fields(claimed: ClaimedRun) -> dict[str, Any]:
    return {
        "run_id": str(claimed.id),
        "task_id": claimed.task_id,
        "attempt": claimed.attempt,
        "queue": claimed.queue,
    }


def _error_text(failure: Failure) -> str:
    try:
        error = json.loads(failure.error)
        return f"{error.get('type')}: {error.get('message')}"
    except (ValueError, AttributeError):  # pragma: no cover - always written by us
        return failure.error


class Attempt:
    """One attempt's log records, span and measurements; made by :func:`begin_attempt`."""

    __slots__ = ("_attrs", "_claimed", "_log", "_meters", "_span", "_token")

    def __init__(self, claimed: ClaimedRun, lease: timedelta) -> None:
        self._claimed = claimed
        self._log = log.isEnabledFor(_INFO)
        self._meters = instruments()
        self._span: Any = None
        self._token: Any = None
        self._attrs = {"runlane.task_id": claimed.task_id, "runlane.queue": claimed.queue}
        if self._log:
            log.info(
                "run %s started: task %s, attempt %d, queue %s",
                claimed.id,
                claimed.task_id,
                claimed.attempt,
                claimed.queue,
                extra=_fields(claimed),
            )
        if self._meters is not None:
            self._meters.started.add(1, self._attrs)
            if claimed.due_at is not None:
                delay = (claimed.lease_expires_at - lease - claimed.due_at).total_seconds()
                self._meters.start_delay.record(max(0.0, delay), self._attrs)
        if tracing_enabled():
            parent = None
            if isinstance(claimed.trace_context, dict) and claimed.trace_context:
                try:
                    parent = otel_propagate.extract(claimed.trace_context)
                except Exception:  # a row written elsewhere, or by hand: start a new trace
                    log.warning(
                        "runlane: run %s has a trace context propagation cannot read (%r); "
                        "its attempt starts a new trace",
                        claimed.id,
                        claimed.trace_context,
                        exc_info=True,
                    )
            self._span = _tracer().start_span(
                "runlane.run",
                context=parent,
                kind=otel_trace.SpanKind.CONSUMER,
                attributes={
                    "runlane.run_id": str(claimed.id),
                    "runlane.task_id": claimed.task_id,
                    "runlane.attempt": claimed.attempt,
                    "runlane.queue": claimed.queue,
                },
            )
            self._token = otel_context.attach(otel_trace.set_span_in_context(self._span))

    def abort(self, exc: BaseException) -> None:
        """The handler raised past the worker (KeyboardInterrupt, SystemExit)."""
        if self._span is not None:
            self._span.record_exception(exc)
            self._span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, repr(exc)))
            self._close_span()

    def _close_span(self) -> None:
        self._span.end()
        otel_context.detach(self._token)
        self._span = None

    def end(self, kind: str, write: Completion | Failure | LeaseRef | None, seconds: float) -> None:
        claimed = self._claimed
        if self._span is not None:
            span = self._span
            span.set_attribute("runlane.outcome", kind)
            if isinstance(write, Failure):
                text = _error_text(write)
                span.add_event("exception", {"exception.message": text})
                span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, text))
            elif kind == TIMED_OUT:
                span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, "timed out"))
            self._close_span()
        meters = self._meters
        if meters is not None:
            meters.duration.record(seconds, {**self._attrs, "runlane.outcome": kind})
            counter = {
                COMPLETED: meters.completed,
                FAILED: meters.failed,
                RETRIED: meters.retried,
                HANDED_BACK: meters.handed_back,
                CANCELLED: meters.cancelled,
            }.get(kind)
            if counter is not None:
                counter.add(1, self._attrs)
        if self._log:
            _log_end(claimed, kind, write, seconds)


_MESSAGES = {
    COMPLETED: "run %s completed in %.1f ms (task %s, attempt %d)",
    HANDED_BACK: "run %s handed back unspent after %.1f ms (task %s, attempt %d)",
    CANCELLED: "run %s cancelled after %.1f ms (task %s, attempt %d)",
    TIMED_OUT: "run %s timed out after %.1f ms; the attempt failed at its task timeout, a "
    "late result is discarded (task %s, attempt %d)",
    LEASE_LOST: "run %s lost its lease after %.1f ms; nothing written (task %s, attempt %d)",
    DISCARDED: "run %s finished after %.1f ms, after it was handed back (task %s, attempt %d)",
    SUSPENDED: "run %s suspended after %.1f ms: waiting, sleeping or released "
    "(task %s, attempt %d)",
}


def _log_end(claimed: ClaimedRun, kind: str, write: Any, seconds: float) -> None:
    if kind in (RETRIED, FAILED):
        return  # logged once, at WARNING/ERROR with its traceback, by runlane.worker._failure_log
    ms = round(seconds * 1000.0, 3)
    extra = {**_fields(claimed), "duration_ms": ms, "outcome": kind}
    message = _MESSAGES.get(kind, _MESSAGES[SUSPENDED])
    log.info(message, claimed.id, ms, claimed.task_id, claimed.attempt, extra=extra)


def begin_attempt(claimed: ClaimedRun, lease: timedelta) -> Attempt | None:
    """Log, span and count the start of an attempt; None when logs (at INFO), tracing and
    metrics are all off."""
    if log.isEnabledFor(_INFO) or tracing_enabled() or instruments() is not None:
        return Attempt(claimed, lease)
    return None


def handed_back(runs: Sequence[ClaimedRun]) -> None:
    """Runs a closing worker handed back without running them (counted as hand-backs)."""
    meters = instruments()
    if meters is not None:
        for claimed in runs:
            meters.handed_back.add(
                1, {"runlane.task_id": claimed.task_id, "runlane.queue": claimed.queue}
            )
