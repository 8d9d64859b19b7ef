"""Runs one claimed attempt in the calling thread and decides its outcome.

Pure with respect to storage: it returns the fenced write to make (a Completion or a
Failure) and leaves writing it to the caller, so drain and the worker share it.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Mapping
from typing import Any

import attrs

from runlane._codec import OutputNotSerializable, decode_payload, dump_json, encode_output
from runlane.context import ContextBackend, RunContext, Suspended
from runlane.errors import NonRetryableError, PayloadValidationError, TaskNotFound
from runlane.models import RunError
from runlane.storage import ClaimedRun, Completion, Failure
from runlane.tasks import Task

__all__ = ["Outcome", "TaskTimeout", "execute_attempt", "make_context", "timeout_failure"]

log = logging.getLogger("runlane.execution")


class TaskTimeout(Exception):
    """An attempt ran past its task's timeout; recorded as the attempt's error."""


TaskTimeout.__module__ = "runlane"


@attrs.frozen
class Outcome:
    """The write that finishes an attempt, and whether a handler actually ran."""

    write: Completion | Failure | None  # None: the run was suspended, already written
    handler_ran: bool


def make_context(claimed: ClaimedRun, environment: str, backend: ContextBackend) -> RunContext:
    return RunContext(
        run_id=claimed.id,
        task_id=claimed.task_id,
        queue=claimed.queue,
        attempt=claimed.attempt,
        max_attempts=claimed.max_attempts,
        environment=environment,
        backend=backend,
        lease_token=claimed.lease_token,
    )


def _error_json(error: RunError) -> str:
    return dump_json(attrs.asdict(error))


def _storable(text: str) -> str:
    """Postgres text cannot hold NUL; keep the message readable instead of losing it."""
    return text.replace("\x00", "\\x00")


def timeout_failure(claimed: ClaimedRun, task: Task[Any, Any] | None) -> Failure:
    """The failure recorded for an attempt that passed its task's timeout (retried per policy)."""
    timeout = task.timeout if task is not None else None
    exc = TaskTimeout(
        f"attempt {claimed.attempt} of task {claimed.task_id!r} ran longer than its timeout "
        f"({timeout}); its handler was signalled through context.cancelled and its result, "
        "should it still return, is discarded"
    )
    return _failure(claimed, exc, retry=task, with_tb=False)


def _failure(
    claimed: ClaimedRun, exc: BaseException, *, retry: Task[Any, Any] | None, with_tb: bool = True
) -> Failure:
    retryable = retry is not None and claimed.attempts_consumed < claimed.max_attempts
    module = type(exc).__module__
    error = RunError(
        type=type(exc).__qualname__
        if module == "builtins"
        else f"{module}.{type(exc).__qualname__}",
        message=_storable(str(exc)),
        traceback=_storable("".join(traceback.format_exception(exc))) if with_tb else None,
        retryable=retry is not None,
    )
    delay = (
        retry.retry.delay_after(claimed.attempts_consumed)
        if retry is not None and retryable
        else None
    )
    return Failure(
        run_id=claimed.id,
        attempt=claimed.attempt,
        lease_token=claimed.lease_token,
        error=_error_json(error),
        retry_delay=delay,
    )


def execute_attempt(
    claimed: ClaimedRun,
    tasks: Mapping[str, Task[Any, Any]],
    context: RunContext,
) -> Outcome:
    """Run the handler for ``claimed`` and return the fenced write that records the result.

    Exceptions become failures: ``NonRetryableError``, an unknown task, a stored payload that
    no longer fits the schema and an output that cannot be serialized fail the run at once;
    any other ``Exception`` consumes an attempt and retries per the task's policy.
    ``BaseException`` (KeyboardInterrupt, SystemExit) propagates: the lease lapses and
    maintenance recovers the run.
    """
    task = tasks.get(claimed.task_id)
    if task is None:
        missing = TaskNotFound(
            f"task {claimed.task_id!r} is not registered with the runtime that claimed run "
            f"{claimed.id}; every worker polling queue {claimed.queue!r} must register every "
            "task producers put there"
        )
        return Outcome(_failure(claimed, missing, retry=None, with_tb=False), handler_ran=False)
    try:
        payload = decode_payload(task.id, task.schema, claimed.payload)
    except PayloadValidationError as exc:
        return Outcome(_failure(claimed, exc, retry=None, with_tb=False), handler_ran=False)
    try:
        result = task.fn(payload, context)
    except Suspended:
        return Outcome(None, handler_ran=True)
    except NonRetryableError as exc:
        return Outcome(_failure(claimed, exc, retry=None), handler_ran=True)
    except Exception as exc:
        log.info("run %s attempt %d of %s raised %r", claimed.id, claimed.attempt, task.id, exc)
        return Outcome(_failure(claimed, exc, retry=task), handler_ran=True)
    try:
        output = encode_output(result)
    except OutputNotSerializable as exc:
        return Outcome(_failure(claimed, exc, retry=None, with_tb=False), handler_ran=True)
    completion = Completion(
        run_id=claimed.id, attempt=claimed.attempt, lease_token=claimed.lease_token, output=output
    )
    return Outcome(completion, handler_ran=True)
