"""The log record of a failed attempt: one per failure, on logger ``runlane.worker``.

A run that failed for good is logged at ERROR and a failed attempt that will be retried at
WARNING, both with the exception (``exc_info``, so Sentry's and other logging integrations
see the traceback) and with ``run_id``, ``task_id``, ``attempt``, ``queue``, ``outcome``
(``failed`` or ``retried``), ``error_type``, ``duration_ms`` and, when retried,
``retry_delay_s`` as ``extra`` fields. The worker calls it in the handler's thread, inside the
runtime's middleware.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runlane.storage import ClaimedRun, Failure
    from runlane.worker._execution import Outcome

__all__ = ["log_failure"]

log = logging.getLogger("runlane.worker")


def _error(failure: Failure) -> tuple[str, str]:
    try:
        error = json.loads(failure.error)
        return str(error.get("type")), str(error.get("message"))
    except (ValueError, AttributeError):  # pragma: no cover - always written by runlane
        return "unknown", failure.error


def log_failure(claimed: ClaimedRun, outcome: Outcome, seconds: float) -> None:
    """Log the failure ``outcome`` (its write is a Failure) of ``claimed``'s attempt."""
    failure: Failure = outcome.write  # type: ignore[assignment]
    retried = failure.retry_delay is not None
    level = logging.WARNING if retried else logging.ERROR
    if not log.isEnabledFor(level):
        return
    error_type, message = _error(failure)
    extra: dict[str, Any] = {
        "run_id": str(claimed.id),
        "task_id": claimed.task_id,
        "attempt": claimed.attempt,
        "queue": claimed.queue,
        "outcome": "retried" if retried else "failed",
        "error_type": error_type,
        "duration_ms": round(seconds * 1000.0, 3),
    }
    exc = outcome.error
    exc_info = None if exc is None else (type(exc), exc, exc.__traceback__)
    note = "" if outcome.note is None else f" ({outcome.note})"
    if failure.retry_delay is not None:
        delay = failure.retry_delay.total_seconds()
        extra["retry_delay_s"] = delay
        log.warning(
            "run %s attempt %d failed; retry in %.1fs (task %s, queue %s): %s: %s%s",
            claimed.id,
            claimed.attempt,
            delay,
            claimed.task_id,
            claimed.queue,
            error_type,
            message,
            note,
            exc_info=exc_info,
            extra=extra,
        )
        return
    log.error(
        "run %s failed for good at attempt %d (task %s, queue %s): %s: %s%s",
        claimed.id,
        claimed.attempt,
        claimed.task_id,
        claimed.queue,
        error_type,
        message,
        note,
        exc_info=exc_info,
        extra=extra,
    )
