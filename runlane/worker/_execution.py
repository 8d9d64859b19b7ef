"""Runs one claimed attempt in the calling thread and decides its outcome.

Pure with respect to storage: it returns the fenced write to make (a Completion, a Failure
or a hand-back) and leaves writing it to the caller, the worker's lifecycle writer.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from runlane._attempt import AttemptControl
from runlane._codec import (
    OutputNotSerializable,
    OutputTooLarge,
    decode_payload,
    dump_json,
    encode_output,
    exception_text,
)
from runlane._limits import truncate_message, truncate_traceback
from runlane.context import ContextBackend, RunContext, Suspended
from runlane.errors import (
    NonRetryableError,
    PayloadValidationError,
    RunInterrupted,
    StopReason,
    TaskNotFound,
    TaskTimeout,
)
from runlane.models import RunError
from runlane.retry import next_retry_delay
from runlane.storage import ClaimedRun, Completion, Failure, LeaseRef
from runlane.tasks import Task
from runlane.worker._middleware import Middleware, MiddlewareStack

__all__ = [
    "Outcome",
    "Write",
    "execute_attempt",
    "make_context",
    "refused_output_failure",
    "timeout_failure",
]

log = logging.getLogger("runlane.execution")

# what finishes an attempt: complete it, fail it, or hand it back unspent (a LeaseRef)
Write = Completion | Failure | LeaseRef

# what a handler may raise to stop its worker (the process is being stopped); every other
# BaseException but runlane's own Suspended fails the attempt like an exception
_WORKER_STOPS: tuple[type[BaseException], ...] = (KeyboardInterrupt, SystemExit)


@attrs.frozen
class Outcome:
    """The write that finishes an attempt, and whether a handler actually ran."""

    write: Write | None  # None: nothing to write (suspended and written, or not ours)
    handler_ran: bool
    # the exception behind a Failure write (None for a timeout recorded by the writer)
    error: BaseException | None = None
    note: str | None = None  # what the failure's log record adds (why it is recorded so)


def make_context(
    claimed: ClaimedRun, environment: str, backend: ContextBackend, control: AttemptControl
) -> RunContext:
    return RunContext(
        run_id=claimed.id,
        task_id=claimed.task_id,
        queue=claimed.queue,
        attempt=claimed.attempt,
        max_attempts=claimed.max_attempts,
        environment=environment,
        backend=backend,
        lease_token=claimed.lease_token,
        cancelled=control.cancelled,
        control=control,
    )


def _error_json(error: RunError) -> str:
    return dump_json(attrs.asdict(error))


def _storable(text: str) -> str:
    """Postgres text cannot hold NUL nor JSON a lone surrogate; keep the message readable
    (escaped) instead of losing it."""
    text = text.replace("\x00", "\\x00")
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _message(exc: BaseException) -> str:
    """``str(exc)``, bounded; an exception whose ``__str__`` fails still gets a message."""
    return truncate_message(_storable(exception_text(exc)))


def _traceback(exc: BaseException) -> str:
    try:
        text = "".join(traceback.format_exception(exc))
    except Exception as failure:  # user code: any failure is possible
        text = f"<formatting the traceback raised {type(failure).__name__}>"
    return truncate_traceback(_storable(text))


def timeout_failure(claimed: ClaimedRun, task: Task[Any, Any] | None) -> Outcome:
    """The failure recorded for an attempt that passed its task's timeout (retried per
    policy), as the outcome the failure log reads."""
    timeout = task.timeout if task is not None else None
    exc = TaskTimeout(
        f"attempt {claimed.attempt} of task {claimed.task_id!r} ran longer than its timeout "
        f"({timeout}); its handler was signalled through context.cancelled and its result, "
        "should it still return, is discarded"
    )
    return Outcome(_failure(claimed, exc, retry=task, with_tb=False), handler_ran=True, error=exc)


def refused_output_failure(completion: Completion, reason: str) -> Failure:
    """The failure recorded for an attempt whose return value the database refused to store
    (``reason``: its words); within ``max_output_bytes`` as JSON text, it can be too large
    as jsonb. Not retried, as an output over ``max_output_bytes`` is not: the handler would
    return it again."""
    refused = OutputTooLarge(
        f"the handler's return value is too large for Postgres to store ({reason}); "
        "return less: store large results elsewhere and return a reference"
    )
    return Failure(
        run_id=completion.run_id,
        attempt=completion.attempt,
        lease_token=completion.lease_token,
        error=_error_json(_run_error(refused, with_tb=False, retryable=False)),
        retry_delay=None,
    )


def _run_error(exc: BaseException, *, with_tb: bool, retryable: bool) -> RunError:
    module = type(exc).__module__
    name = type(exc).__qualname__
    return RunError(
        # a class's names are the user's too: stored like its message
        type=truncate_message(_storable(name if module == "builtins" else f"{module}.{name}")),
        message=_message(exc),
        traceback=_traceback(exc) if with_tb else None,
        retryable=retryable,
    )


def _failure(
    claimed: ClaimedRun, exc: BaseException, *, retry: Task[Any, Any] | None, with_tb: bool = True
) -> Failure:
    """The failed attempt's write; ``retry`` is the task whose policy may retry it (None:
    the failure is not retryable). The delay, or None once attempts are spent, comes from
    ``next_retry_delay``, the arithmetic maintenance uses for expired attempts too."""
    delay = next_retry_delay(
        None if retry is None else retry.retry, claimed.attempts_consumed, claimed.max_attempts
    )
    return Failure(
        run_id=claimed.id,
        attempt=claimed.attempt,
        lease_token=claimed.lease_token,
        error=_error_json(_run_error(exc, with_tb=with_tb, retryable=retry is not None)),
        retry_delay=delay,
    )


def _interrupted(claimed: ClaimedRun, exc: RunInterrupted) -> Write | None:
    """How a handler that raised RunInterrupted is recorded: shutdown and cancel hand the
    attempt back unspent (a run whose cancellation was requested then ends ``cancelled``);
    a timeout was already recorded as a failed attempt, and a lost lease allows no write."""
    reason = getattr(exc, "reason", None)
    if reason in (StopReason.SHUTDOWN, StopReason.CANCEL_REQUESTED):
        return claimed.ref
    return None


def execute_attempt(
    claimed: ClaimedRun,
    tasks: Mapping[str, Task[Any, Any]],
    context: RunContext,
    middleware: Sequence[Middleware] = (),
    report: Callable[[Outcome], None] | None = None,
    *,
    control: AttemptControl,
    max_output: int,
) -> Outcome:
    """Run the handler for ``claimed`` inside ``middleware`` and return the fenced write that
    records the result.

    Exceptions become failures: ``NonRetryableError``, an unknown task, a stored payload that
    no longer fits the schema and an output that cannot be serialized fail the run at once;
    any other ``Exception`` consumes an attempt and retries per the task's policy, and so
    does a ``BaseException`` that is not one (``asyncio.CancelledError`` leaked by a
    library, ``GeneratorExit``, a user's own). Only ``KeyboardInterrupt`` and ``SystemExit``
    propagate, and stop the worker: the lease lapses and maintenance recovers the run.

    An exception a middleware raises entering or exiting fails the attempt as the handler's
    would. ``report`` is called once with every outcome that fails the attempt, inside the
    middleware when they are entered (an error-reporting scope sees the failure's record).
    ``control`` is the engine's side of ``context`` (was the exception an outage it met);
    ``max_output`` the runtime's limit on the handler's return value.
    """
    task = tasks.get(claimed.task_id)
    if task is None:
        missing = TaskNotFound(
            f"task {claimed.task_id!r} is not registered with the runtime that claimed run "
            f"{claimed.id}; every worker polling queue {claimed.queue!r} must register every "
            "task producers put there"
        )
        failed = _failure(claimed, missing, retry=None, with_tb=False)
        return _reported(Outcome(failed, handler_ran=False, error=missing), report)
    try:
        payload = decode_payload(task.id, task.schema, claimed.payload)
    except _WORKER_STOPS:
        raise
    except BaseException as exc:  # PayloadValidationError, or a BaseException a hook raised
        tb = not isinstance(exc, PayloadValidationError)
        failed = _failure(claimed, exc, retry=None, with_tb=tb)
        return _reported(Outcome(failed, handler_ran=False, error=exc), report)
    if not middleware:
        outcome, _ = _run(claimed, task, payload, context, control=control, max_output=max_output)
        return _reported(outcome, report)
    stack = MiddlewareStack()
    try:
        stack.enter(middleware, context)
    except _WORKER_STOPS:
        raise
    except BaseException as exc:
        return _reported(_raised(claimed, task, control, exc, handler_ran=False), report)
    try:
        outcome, raised = _run(
            claimed, task, payload, context, control=control, max_output=max_output
        )
    except BaseException as exc:  # KeyboardInterrupt, SystemExit: the worker stops
        stack.exit(exc)
        raise
    _reported(outcome, report)  # inside the middleware: a reporting scope sees it
    exit_error = stack.exit(raised)
    if exit_error is None or isinstance(exit_error, _WORKER_STOPS):
        if exit_error is not None:
            raise exit_error
        return outcome
    if isinstance(outcome.write, Completion):
        return _reported(_raised(claimed, task, control, exit_error, handler_ran=True), report)
    # the attempt already failed, was handed back or suspended: that stands
    log.warning(
        "run %s attempt %d of %s: a middleware raised %s while exiting; the attempt's "
        "outcome (%s) stands",
        claimed.id,
        claimed.attempt,
        task.id,
        type(exit_error).__name__,
        type(outcome.write).__name__ if outcome.write is not None else "suspended",
        exc_info=(type(exit_error), exit_error, exit_error.__traceback__),
    )
    return outcome


def _reported(outcome: Outcome, report: Callable[[Outcome], None] | None) -> Outcome:
    if report is not None and isinstance(outcome.write, Failure):
        report(outcome)
    return outcome


def _run(
    claimed: ClaimedRun,
    task: Task[Any, Any],
    payload: Any,
    context: RunContext,
    *,
    control: AttemptControl,
    max_output: int,
) -> tuple[Outcome, BaseException | None]:
    """Call the handler and encode its output: the outcome, and the exception the handler
    raised (for the middleware to see) if any."""
    try:
        result = task.fn(payload, context)
    except Suspended:
        return Outcome(None, handler_ran=True), None
    except _WORKER_STOPS:
        raise
    except BaseException as exc:
        return _raised(claimed, task, control, exc, handler_ran=True), exc
    try:
        output = encode_output(result, max_output, what="the handler's return value")
    except _WORKER_STOPS:
        raise
    except BaseException as exc:  # OutputNotSerializable, or a BaseException a hook raised
        tb = not isinstance(exc, OutputNotSerializable)
        failed = _failure(claimed, exc, retry=None, with_tb=tb)
        return Outcome(failed, handler_ran=True, error=exc), None
    completion = Completion(
        run_id=claimed.id, attempt=claimed.attempt, lease_token=claimed.lease_token, output=output
    )
    return Outcome(completion, handler_ran=True), None


def _raised(
    claimed: ClaimedRun,
    task: Task[Any, Any],
    control: AttemptControl,
    exc: BaseException,
    *,
    handler_ran: bool,
) -> Outcome:
    """How an attempt whose handler (or a middleware) raised ``exc`` is recorded."""
    if isinstance(exc, RunInterrupted):
        if control.stop_reason is not None:
            return Outcome(_interrupted(claimed, exc), handler_ran=handler_ran)
        # raised with no stop asked of this attempt (the handler set context.cancelled
        # itself, or raised it): a failure like any other, or the hand-back would deliver
        # the run again at once, unspent, without end
        return Outcome(
            _failure(claimed, exc, retry=task),
            handler_ran=handler_ran,
            error=exc,
            note="it raised RunInterrupted, but no stop was asked of it (to cancel a run, "
            "call Runlane.cancel(run_id))",
        )
    if isinstance(exc, NonRetryableError):
        return Outcome(_failure(claimed, exc, retry=None), handler_ran=handler_ran, error=exc)
    if not isinstance(exc, Exception):
        return Outcome(
            _failure(claimed, exc, retry=task),
            handler_ran=handler_ran,
            error=exc,
            note=f"{type(exc).__name__} is a BaseException that is not an Exception (a "
            "library's asyncio.CancelledError?)",
        )
    if control.outage_behind(exc):
        log.warning(
            "run %s attempt %d of %s: a durable operation could not reach the database; "
            "handing the attempt back unspent",
            claimed.id,
            claimed.attempt,
            task.id,
        )
        return Outcome(claimed.ref, handler_ran=handler_ran)
    return Outcome(_failure(claimed, exc, retry=task), handler_ran=handler_ran, error=exc)
