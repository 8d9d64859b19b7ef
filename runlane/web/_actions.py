"""The console's actions: retry and cancel a run, bulk retry/cancel by filter, pause and
resume queues and schedules, run a schedule now. Every action is a POST that must carry the
CSRF token and be allowed by ``authorize``; it then redirects to a page (post/redirect/get).
The bulk confirmation (a GET) counts what a bulk action would change first."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, cast

import attrs
from flask import Response, abort, redirect, render_template, request, url_for

from runlane._operator.bulk import BulkFilters, bulk_filter
from runlane.errors import ConfigurationError
from runlane.models import BulkResult, RunStatus
from runlane.runtime import Runlane
from runlane.web._console import Console, Route
from runlane.web._filters import RunFilters, run_filters, run_id_arg, text_arg

__all__ = [
    "BULK_COUNT_CAP",
    "BULK_COUNT_SECONDS",
    "BULK_LIMIT",
    "Actions",
    "bulk_action_arg",
    "bulk_method",
    "form_reason",
]

BULK_COUNT_CAP = 10_000  # a bulk confirmation counts up to this many matches
# ... within this much of the database's time; a count that would take longer (the filter
# matches few of many runs it must read) shows the database's estimate, marked as one
BULK_COUNT_SECONDS = 0.1
BULK_LIMIT = 10_000  # runs one confirmed bulk action changes at most (newest first)

_NONCE = re.compile(r"^[A-Za-z0-9_-]{16,64}$")


def bulk_action_arg(console: Console, source: Any) -> str:
    """The bulk ``action`` of ``source`` (retry, cancel or delete; 400 otherwise), one this
    console's ``authorize`` may allow (403 when it never does)."""
    action = source.get("action", "")
    if action not in {"retry", "cancel", "delete"}:
        abort(400, "action must be retry, cancel or delete")
    if not console.guard.allows(f"bulk_{action}"):
        abort(403, f"this console does not allow bulk {action} here")
    return str(action)


def bulk_method(runlane: Runlane, action: str) -> Callable[..., BulkResult]:
    """``retry_runs``, ``cancel_runs`` or ``delete_runs`` of ``runlane``, for ``action``."""
    methods: dict[str, Callable[..., BulkResult]] = {
        "retry": runlane.retry_runs,
        "cancel": runlane.cancel_runs,
        "delete": runlane.delete_runs,
    }
    return methods[action]


def form_reason() -> str | None:
    """The form's optional reason, for the audit trail."""
    return text_arg(request.form, "reason")


class Actions:
    """Single-run, bulk, queue and schedule actions."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.runlane = console.runlane

    def routes(self) -> Iterable[Route]:
        return (
            ("/runs/<run_id>/retry", "retry", ["POST"], self.retry),
            ("/runs/<run_id>/cancel", "cancel", ["POST"], self.cancel),
            ("/runs/bulk", "bulk_confirm", ["GET"], self.bulk_confirm),
            ("/runs/bulk", "bulk_apply", ["POST"], self.bulk_apply),
            ("/queues/pause", "pause_queue", ["POST"], self.pause_queue),
            ("/queues/resume", "resume_queue", ["POST"], self.resume_queue),
            ("/schedules/pause", "pause_schedule", ["POST"], self.pause_schedule),
            ("/schedules/resume", "resume_schedule", ["POST"], self.resume_schedule),
            ("/schedules/run", "trigger_schedule", ["POST"], self.trigger_schedule),
        )

    # -- single-run actions ------------------------------------------------------------------

    def retry(self, run_id: str) -> Response:
        self.console.allowed("retry")
        key = run_id_arg(run_id)
        self.runlane.retry_run(key, reason=form_reason())
        return self.console.done("runlane.run", "retried", run_id=str(key))

    def cancel(self, run_id: str) -> Response:
        self.console.allowed("cancel")
        key = run_id_arg(run_id)
        result = self.runlane.cancel(key, reason=form_reason())
        if not result.changed:
            notice = "unchanged"
        elif result.status is RunStatus.CANCELLATION_REQUESTED:
            notice = "cancel_requested"
        else:
            notice = "cancelled"
        return self.console.done("runlane.run", notice, run_id=str(key))

    # -- bulk actions --------------------------------------------------------------------------

    def check_filters(self, filters: RunFilters) -> None:
        if not filters.any:
            raise ConfigurationError(
                "choose at least one filter (status, task, queue or a time) before a bulk "
                "action; the console does not act on every run at once"
            )

    def bulk_call(self, action: str, filters: RunFilters, **options: Any) -> Any:
        self.check_filters(filters)
        method = bulk_method(self.runlane, action)
        return method(**attrs.asdict(filters, recurse=False), **options)

    def bulk_confirm(self) -> str:
        action = bulk_action_arg(self.console, request.args)
        filters = run_filters(request.args)
        self.check_filters(filters)
        runs, _ = bulk_filter(
            action,
            self.runlane.environment,
            BulkFilters(
                status=filters.status,
                task=filters.task,
                queue=filters.queue,
                created_after=filters.created_after,
                created_before=filters.created_before,
            ),
        )
        counted, exact = self.console.storage().run_bulk_count_within(
            runs, BULK_COUNT_CAP + 1, BULK_COUNT_SECONDS
        )
        return render_template(
            "runlane/bulk.html",
            page="runs",
            action=action,
            filters=filters,
            matched=min(counted, BULK_COUNT_CAP) if exact else counted,
            more=exact and counted > BULK_COUNT_CAP,
            estimated=not exact,
            limit=BULK_LIMIT,
        )

    def bulk_apply(self) -> Response:
        action = bulk_action_arg(self.console, request.form)
        self.console.allowed(f"bulk_{action}")
        filters = run_filters(request.form)
        result = self.bulk_call(action, filters, limit=BULK_LIMIT, reason=form_reason())
        values: dict[str, Any] = {
            **filters.args(),
            "done": "bulk",
            "changed": result.changed,
            "matched": result.matched,
        }
        return cast(Response, redirect(url_for("runlane.runs", **values), code=303))

    # -- queues and schedules --------------------------------------------------------------------

    def named(self, field: str) -> str:
        value = request.form.get(field, "")
        if not value:
            abort(400, f"the form has no {field}")
        return value

    def pause_queue(self) -> Response:
        self.console.allowed("pause_queue")
        self.runlane.pause_queue(self.named("name"), reason=form_reason())
        return self.console.done("runlane.queues", "queue_paused")

    def resume_queue(self) -> Response:
        self.console.allowed("resume_queue")
        self.runlane.resume_queue(self.named("name"), reason=form_reason())
        return self.console.done("runlane.queues", "queue_resumed")

    def pause_schedule(self) -> Response:
        self.console.allowed("pause_schedule")
        self.runlane.pause_schedule(self.named("id"), reason=form_reason())
        return self.console.done("runlane.schedules", "schedule_paused")

    def resume_schedule(self) -> Response:
        self.console.allowed("resume_schedule")
        self.runlane.resume_schedule(self.named("id"), reason=form_reason())
        return self.console.done("runlane.schedules", "schedule_resumed")

    def trigger_schedule(self) -> Response:
        self.console.allowed("trigger_schedule")
        schedule_id = self.named("id")
        nonce = request.form.get("nonce", "")
        # the form's nonce makes a double submit (or a retried request) one run, not two;
        # bound to the schedule, so a nonce sent again for another schedule of the same task
        # makes that schedule's run instead of finding the first one (keys are per task).
        # The nonce holds no ':', so (nonce, schedule) pairs never share a key.
        key = f"console-{nonce}:{schedule_id}" if _NONCE.match(nonce) else None
        handle = self.runlane.trigger_schedule_now(
            schedule_id, idempotency_key=key, reason=form_reason()
        )
        notice = "triggered" if handle.created else "triggered_before"
        return self.console.done("runlane.run", notice, run_id=str(handle.id))
