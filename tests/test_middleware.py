"""create_runlane(middleware=[...]): context managers entered around every attempt, refused
at create_runlane when they cannot be one; the failure log contract (one record per failure,
ERROR when final and WARNING when retried, with exc_info), TaskNotFound and poison cases."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest

from runlane import (
    ConfigurationError,
    NonRetryableError,
    RetryPolicy,
    RunContext,
    RunStatus,
    create_runlane,
    task,
)
from runlane.postgres import postgres_polling_lane
from tests.conftest import RunlaneFactory


@attrs.frozen
class Job:
    kind: str


events: list[str] = []
_local = threading.local()


@task(id="mw.job", schema=Job, retry=RetryPolicy(max_attempts=2))
def job(payload: Job, context: RunContext) -> str:
    events.append(f"handler {payload.kind} in {'/'.join(getattr(_local, 'stack', []))}")
    if payload.kind == "fail":
        raise ValueError("handler failed")
    if payload.kind == "fatal":
        raise NonRetryableError("handler gave up")
    return payload.kind


@task(id="mw.once", schema=Job, retry=RetryPolicy(max_attempts=1))
def once(payload: Job, context: RunContext) -> str:
    events.append("handler once")
    return payload.kind


@pytest.fixture(autouse=True)
def _clear() -> Iterator[None]:
    events.clear()
    yield
    events.clear()


def layer(name: str) -> Callable[[RunContext], contextlib.AbstractContextManager[None]]:
    @contextlib.contextmanager
    def middleware(context: RunContext) -> Iterator[None]:
        stack = getattr(_local, "stack", [])
        _local.stack = [*stack, name]
        events.append(f"enter {name} run {context.run_id} in {threading.current_thread().name}")
        try:
            yield
        except BaseException as exc:
            events.append(f"exit {name} with {type(exc).__name__}")
            raise
        else:
            events.append(f"exit {name}")
        finally:
            _local.stack = stack

    return middleware


def lane() -> Any:
    return postgres_polling_lane(connection_string="postgresql://localhost/none", schema="x")


class NotAManager:
    pass


def no_argument() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def annotated_none(context: RunContext) -> None:
    pass


def generator(context: RunContext) -> Iterator[None]:
    yield


async def coroutine(context: RunContext) -> None:
    pass


@pytest.mark.parametrize(
    ("middleware", "words"),
    [
        ([42], "middleware[0] must be callable, got 42"),
        ([contextlib.nullcontext()], "middleware[0] is a context manager"),
        ([layer("ok"), "text"], "middleware[1] must be callable, got 'text'"),
        ([no_argument], "cannot be called with one argument (the RunContext)"),
        ([annotated_none], "annotated to return None, not a context manager"),
        ([generator], "decorate it with @contextlib.contextmanager"),
        ([coroutine], "is an async function"),
        ([NotAManager], "which is not a context manager"),
        (layer("alone"), "middleware must be a list of callables"),
        ("text", "middleware must be a list of callables"),
    ],
)
def test_a_middleware_that_cannot_be_one_is_refused_at_create_runlane(
    middleware: Any, words: str
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        create_runlane(lane=lane(), tasks=[job], middleware=middleware)
    assert words in str(refused.value)
    assert "(context) -> ContextManager" in str(refused.value) or "contextmanager" in str(
        refused.value
    )


def test_accepted_forms() -> None:
    class Scope:
        def __init__(self, context: RunContext) -> None:
            self.context = context

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    create_runlane(
        lane=lane(),
        middleware=[
            layer("a"),
            lambda context: contextlib.nullcontext(),
            Scope,
            contextlib.nullcontext,  # takes an optional argument
        ],
    )


def test_middleware_wrap_every_attempt_first_listed_outermost(
    make_runlane: RunlaneFactory,
) -> None:
    rl = make_runlane(tasks=[job], middleware=[layer("outer"), layer("inner")])
    ok = rl.trigger(job, {"kind": "ok"})
    result = rl.drain()
    assert (result.completed, result.failed) == (1, 0)
    thread = threading.current_thread().name  # drain runs handlers in the caller's thread
    assert events == [
        f"enter outer run {ok.id} in {thread}",
        f"enter inner run {ok.id} in {thread}",
        "handler ok in outer/inner",
        "exit inner",
        "exit outer",
    ]
    events.clear()

    failing = rl.trigger(job, {"kind": "fatal"})
    with rl.create_delivery_worker(concurrency=1):
        run = rl.wait_for_run(failing.id, timeout=15)
    assert run.status is RunStatus.FAILED
    assert events[2] == "handler fatal in outer/inner"
    assert events[3:] == ["exit inner with NonRetryableError", "exit outer with NonRetryableError"]
    assert events[0].startswith(f"enter outer run {failing.id} in runlane-worker-")


def test_a_middleware_that_raises_fails_the_attempt_and_the_worker_goes_on(
    make_runlane: RunlaneFactory,
) -> None:
    broken = {"enter": True, "exit": False}

    @contextlib.contextmanager
    def flaky(context: RunContext) -> Iterator[None]:
        if broken["enter"]:
            raise RuntimeError("no database session")
        yield
        if broken["exit"]:
            raise RuntimeError("commit failed")

    rl = make_runlane(tasks=[once], middleware=[layer("outer"), flaky])
    with rl.create_delivery_worker(concurrency=1):
        first = rl.trigger(once, {"kind": "ok"})
        # enter raised: the attempt failed (the task allows one)
        run = rl.wait_for_run(first.id, timeout=15)
        assert run.status is RunStatus.FAILED
        assert run.attempts_spent == 1
        assert run.error is not None
        assert run.error.type == "RuntimeError"
        assert run.error.message == "no database session"
        assert not any(e.startswith("handler") for e in events)
        # the middleware entered before it was exited with the exception
        assert "exit outer with RuntimeError" in events

        broken.update(enter=False, exit=True)
        second = rl.trigger(once, {"kind": "ok"})
        run = rl.wait_for_run(second.id, timeout=15)
        assert run.status is RunStatus.FAILED  # the handler returned, exiting raised
        assert run.error is not None
        assert run.error.message == "commit failed"
        assert run.error.traceback is not None
        assert "commit failed" in run.error.traceback

        broken.update(exit=False)
        third = rl.trigger(once, {"kind": "ok"})
        assert rl.wait_for_run(third.id, timeout=15).status is RunStatus.COMPLETED


def test_a_middleware_returning_no_context_manager_fails_the_attempt(
    make_runlane: RunlaneFactory,
) -> None:
    def forgetful(context: RunContext):  # type: ignore[no-untyped-def]  # no annotation
        return None

    rl = make_runlane(tasks=[once], middleware=[forgetful])
    handle = rl.trigger(once, {"kind": "ok"})
    assert rl.drain().failed == 1
    run = rl.get_run(handle.id)
    assert run.status is RunStatus.FAILED
    assert run.error is not None
    assert run.error.type == "runlane.ConfigurationError"
    assert "middleware[0] (test_a_middleware_returning_no_context_manager" in run.error.message
    assert "returned None, not a context manager" in run.error.message
    assert events == []


def test_a_middleware_cannot_swallow_a_failure(make_runlane: RunlaneFactory) -> None:
    class Swallow:
        def __init__(self, context: RunContext) -> None:
            pass

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> bool:
            return True  # suppress: ignored

    rl = make_runlane(tasks=[job], middleware=[Swallow])
    handle = rl.trigger(job, {"kind": "fatal"})
    assert rl.drain().failed == 1
    assert rl.get_run(handle.id).status is RunStatus.FAILED


def test_each_failure_is_logged_once_inside_the_middleware(
    make_runlane: RunlaneFactory, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[tuple[str, str, str]] = []

    class Scoped(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            scope = "/".join(getattr(_local, "stack", [])) or "-"
            seen.append((record.name, record.levelname, scope))

    handler = Scoped()
    logging.getLogger("runlane").addHandler(handler)
    try:
        caplog.set_level(logging.INFO, logger="runlane")
        rl = make_runlane(tasks=[job], middleware=[layer("scope")])
        retried = rl.trigger(job, {"kind": "fail"})
        failed = rl.trigger(job, {"kind": "fatal"})
        rl.drain()
    finally:
        logging.getLogger("runlane").removeHandler(handler)
    failures = [r for r in caplog.records if getattr(r, "outcome", None) in ("retried", "failed")]
    assert [(r.levelno, r.run_id) for r in failures] == [  # type: ignore[attr-defined]
        (logging.WARNING, str(retried.id)),
        (logging.ERROR, str(failed.id)),
    ]
    for record in failures:
        assert record.name == "runlane.worker"
        assert record.exc_info is not None
        assert record.task_id == "mw.job"  # type: ignore[attr-defined]
        assert record.queue == "default"  # type: ignore[attr-defined]
        assert record.attempt == 1  # type: ignore[attr-defined]
    # logged inside the middleware, and nothing else mentions the two exceptions
    assert ("runlane.worker", "WARNING", "scope") in seen
    assert ("runlane.worker", "ERROR", "scope") in seen
    for words in ("handler failed", "handler gave up"):
        assert len([r for r in caplog.records if words in r.getMessage()]) == 1


def test_task_not_found_and_a_poison_payload_are_logged_at_error(
    make_runlane: RunlaneFactory, caplog: pytest.LogCaptureFixture
) -> None:
    producer = make_runlane(tasks=[job, task(id="mw.gone", schema=Job)(lambda p, c: None)])
    missing = producer.trigger("mw.gone", {"kind": "ok"})

    @attrs.frozen
    class JobV2:
        kind: int

    @task(id="mw.job", schema=JobV2)
    def job_v2(payload: JobV2, context: RunContext) -> None:
        raise AssertionError("never runs")

    poisoned = producer.trigger(job, {"kind": "text"})
    caplog.set_level(logging.WARNING, logger="runlane")
    consumer = make_runlane(tasks=[job_v2])
    assert consumer.drain().failed == 2
    records = {r.run_id: r for r in caplog.records if hasattr(r, "run_id")}
    assert set(records) == {str(missing.id), str(poisoned.id)}
    gone = records[str(missing.id)]
    assert gone.levelno == logging.ERROR
    assert gone.exc_info is not None
    assert type(gone.exc_info[1]).__name__ == "TaskNotFound"
    assert "task 'mw.gone' is not registered" in gone.getMessage()
    bad = records[str(poisoned.id)]
    assert bad.levelno == logging.ERROR
    assert bad.exc_info is not None
    assert type(bad.exc_info[1]).__name__ == "PayloadValidationError"
    assert bad.error_type == "runlane.PayloadValidationError"  # type: ignore[attr-defined]
