"""The console's pages and actions: a Flask blueprint over one :class:`~runlane.Runlane`.

Pages read through the operator API (``status``, ``list_queues``, ``list_workers``,
``list_schedules``, ``list_runs``, ``get_run_history``, ``get_wait_token``) and three reads
of the storage's own (``web_throughput``, ``web_run_extras``, ``web_runs_estimate``). Every
action is a POST that must carry the CSRF token and be allowed by ``authorize``; it then
redirects to a page (post/redirect/get), whose notice is chosen from a fixed set.
"""

from __future__ import annotations

import logging
import re
import secrets
import uuid
from datetime import datetime
from typing import Any, cast

import attrs
from flask import (
    Blueprint,
    Flask,
    Response,
    abort,
    current_app,
    redirect,
    render_template,
    request,
    url_for,
)
from werkzeug.exceptions import HTTPException

from runlane._operator.bulk import (
    BulkFilters,
    bulk_filter,
    filter_time_field,
    filter_time_text,
    parse_filter_time,
)
from runlane._operator.runs import encode_cursor
from runlane._operator.status import unhealthy
from runlane.errors import (
    ConfigurationError,
    RunlaneClosed,
    RunlaneError,
    RunNotFound,
    RunStateConflict,
    SchemaNotMigrated,
    StorageUnavailable,
)
from runlane.models import RunSnapshot, RunStatus
from runlane.runtime import Runlane
from runlane.storage import Storage
from runlane.toolkit import noun_for, shown
from runlane.web._present import ago, chart, cut, pretty, trace_id, when
from runlane.web._security import CSRF_FIELD, Authorize, Guard

__all__ = ["BULK_COUNT_CAP", "BULK_LIMIT", "PAGE_SIZE", "make_app", "make_blueprint"]

log = logging.getLogger("runlane.web")

PAGE_SIZE = 50  # runs per page of the runs list
CHILDREN_SHOWN = 50  # children listed on a run's page
THROUGHPUT_CAP = 50_000  # finishes the chart counts at most (the newest)
BULK_COUNT_CAP = 10_000  # a bulk confirmation counts up to this many matches
# ... within this much of the database's time; a count that would take longer (the filter
# matches few of many runs it must read) shows the database's estimate, marked as one
BULK_COUNT_SECONDS = 0.1
BULK_LIMIT = 10_000  # runs one confirmed bulk action changes at most (newest first)
REFRESH_SECONDS = 10  # pages reload themselves this often (app.config RUNLANE_REFRESH_SECONDS)

# the notices an action's redirect may ask a page to show
NOTICES = {
    "retried": "The run was queued again.",
    "cancelled": "The run was cancelled.",
    "cancel_requested": "Cancellation was requested; the running attempt is asked to stop.",
    "unchanged": "Nothing changed: the run had already ended or was being cancelled.",
    "bulk": "The bulk action is done.",
    "queue_paused": "The queue is paused.",
    "queue_resumed": "The queue is running again.",
    "schedule_paused": "The schedule is paused.",
    "schedule_resumed": "The schedule is running again.",
    "triggered": "The schedule's run was created.",
    "triggered_before": "This form was sent before: the run it created then is shown.",
}

_NONCE = re.compile(r"^[A-Za-z0-9_-]{16,64}$")
_FIRST_ID = uuid.UUID(int=0)


@attrs.frozen
class _Position:
    """Where a runs page starts: what ``encode_cursor`` reads of a run."""

    created_at: datetime
    id: uuid.UUID


@attrs.frozen
class RunFilters:
    status: str | None
    task: str | None
    queue: str | None
    created_after: datetime | None
    created_before: datetime | None

    @property
    def any(self) -> bool:
        return any(v is not None for v in attrs.astuple(self, recurse=False))

    def args(self) -> dict[str, str]:
        """As query arguments (for links and hidden fields)."""
        pairs = {
            "status": self.status,
            "task": self.task,
            "queue": self.queue,
            "created_after": _time_arg(self.created_after),
            "created_before": _time_arg(self.created_before),
        }
        return {k: v for k, v in pairs.items() if v is not None}

    def field(self, name: str) -> str:
        """The value of the form's ``datetime-local`` input for ``name`` (a time filter)."""
        value = getattr(self, name)
        return "" if value is None else filter_time_field(value)


def _time_arg(value: datetime | None) -> str | None:
    return None if value is None else filter_time_text(value)


def _text(source: Any, name: str) -> str | None:
    value = source.get(name, "")
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value or None


def _time(source: Any, name: str) -> datetime | None:
    value = _text(source, name)
    if value is None:
        return None
    return parse_filter_time(name.replace("_", " "), value, naive_is_utc=True)


def _filters(source: Any) -> RunFilters:
    status = _text(source, "status")
    if status is not None and status not in {s.value for s in RunStatus}:
        raise ConfigurationError(
            f"status {shown(status, 40)} is not a run status; use one of: "
            + ", ".join(s.value for s in RunStatus)
        )
    return RunFilters(
        status=status,
        task=_text(source, "task"),
        queue=_text(source, "queue"),
        created_after=_time(source, "created_after"),
        created_before=_time(source, "created_before"),
    )


def _run_id(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        abort(404)


def make_blueprint(runlane: Runlane, authorize: Authorize | None) -> Blueprint:
    """The console as a blueprint named ``runlane``."""
    if not isinstance(runlane, Runlane):
        raise ConfigurationError(
            f"the web console needs a Runlane (made by create_runlane), got a "
            f"{type(runlane).__name__}"
        )
    return _Console(runlane, Guard(authorize)).blueprint()


# (rule, endpoint, methods): every page and action of the console
_ROUTES = (
    ("/", "overview", ["GET"]),
    ("/runs", "runs", ["GET"]),
    ("/runs/<run_id>", "run", ["GET"]),
    ("/queues", "queues", ["GET"]),
    ("/workers", "workers", ["GET"]),
    ("/schedules", "schedules", ["GET"]),
    ("/runs/<run_id>/retry", "retry", ["POST"]),
    ("/runs/<run_id>/cancel", "cancel", ["POST"]),
    ("/runs/bulk", "bulk_confirm", ["GET"]),
    ("/runs/bulk", "bulk_apply", ["POST"]),
    ("/queues/pause", "pause_queue", ["POST"]),
    ("/queues/resume", "resume_queue", ["POST"]),
    ("/schedules/pause", "pause_schedule", ["POST"]),
    ("/schedules/resume", "resume_schedule", ["POST"]),
    ("/schedules/run", "trigger_schedule", ["POST"]),
)


class _Console:
    """The views of one console: a runtime and its guard."""

    def __init__(self, runlane: Runlane, guard: Guard) -> None:
        self.runlane = runlane
        self.guard = guard

    def blueprint(self) -> Blueprint:
        bp = Blueprint(
            "runlane",
            __name__,
            template_folder="templates",
            static_folder="static",
            static_url_path="/static",
        )
        for rule, endpoint, methods in _ROUTES:
            bp.add_url_rule(rule, endpoint, getattr(self, endpoint), methods=methods)
        bp.context_processor(self.helpers)
        bp.after_request(self.finish)
        bp.register_error_handler(Exception, _error_page)
        return bp

    def storage(self) -> Storage:
        # the console's own reads (runlane.web is part of runlane): opened as the operator API
        # opens it, so a closed runtime or a dead database fails the same way
        return self.runlane.opened_storage()

    def allowed(self, action: str) -> None:
        """Refuse (403) a POST that lacks the CSRF token or that authorize does not allow."""
        if not self.guard.token_valid():
            abort(403, "the form's CSRF token is missing or does not match: reload the page")
        if not self.guard.allows(action):
            abort(403, f"this console does not allow {action.replace('_', ' ')} here")

    def done(self, endpoint: str, notice: str, **values: Any) -> Response:
        return cast(Response, redirect(url_for(endpoint, done=notice, **values), code=303))

    def helpers(self) -> dict[str, Any]:
        return {
            "can": self.guard.allows,
            "read_only": self.guard.read_only(),
            "csrf_field": CSRF_FIELD,
            "csrf_token": self.guard.token,
            "when": when,
            "ago": ago,
            "pretty": pretty,
            "cut": cut,
            "plural": noun_for,
            "notice": NOTICES.get(request.args.get("done", "")),
            "environment": self.runlane.environment,
            "statuses": [s.value for s in RunStatus],
            "refresh": current_app.config.get("RUNLANE_REFRESH_SECONDS", REFRESH_SECONDS),
        }

    def finish(self, response: Response) -> Response:
        return self.guard.finish(response, url_for("runlane.overview"))

    # -- pages -----------------------------------------------------------------------------

    def overview(self) -> str:
        report = self.runlane.status()
        reads = self.storage()
        throughput = reads.web_throughput(self.runlane.environment, THROUGHPUT_CAP)
        return render_template(
            "runlane/overview.html",
            page="overview",
            report=report,
            problems=unhealthy(report),
            workers=self.runlane.list_workers(),
            chart=chart(throughput),
            runs_estimate=reads.web_runs_estimate(),
        )

    def runs(self) -> str:
        filters = _filters(request.args)
        cursor = _text(request.args, "cursor")
        start = cursor
        if start is None and filters.created_before is not None:
            position = _Position(created_at=filters.created_before, id=_FIRST_ID)
            start = encode_cursor(cast(RunSnapshot, position))
        page = self.runlane.list_runs(
            status=filters.status,
            task=filters.task,
            queue=filters.queue,
            limit=PAGE_SIZE,
            cursor=start,
        )
        shown = list(page.runs)
        next_cursor = page.next_cursor
        if filters.created_after is not None:
            after = filters.created_after
            kept = [run for run in shown if run.created_at >= after]
            if len(kept) < len(shown):
                next_cursor = None  # the walk went past created_after: no older page
            shown = kept
        return render_template(
            "runlane/runs.html",
            page="runs",
            filters=filters,
            runs=shown,
            next_cursor=next_cursor,
            first_page=cursor is None,
            runs_estimate=self.storage().web_runs_estimate(),
        )

    def run(self, run_id: str) -> str:
        key = _run_id(run_id)
        history = self.runlane.get_run_history(key)
        extras = self.storage().web_run_extras(self.runlane.environment, key, CHILDREN_SHOWN + 1)
        if extras is None:
            raise RunNotFound(f"no run {key} in environment {self.runlane.environment!r}")
        token = None
        if extras["wait_kind"] == "token" and extras["wait_token_id"] is not None:
            token = self.runlane.get_wait_token(extras["wait_token_id"])
        children = extras["children"]
        snapshot = history.run
        return render_template(
            "runlane/run.html",
            page="runs",
            run=snapshot,
            attempts=history.attempts,
            steps=history.steps,
            extras=extras,
            token=token,
            children=children[:CHILDREN_SHOWN],
            more_children=len(children) > CHILDREN_SHOWN,
            trace=trace_id(extras["trace_context"]),
            progress=snapshot.progress if isinstance(snapshot.progress, dict) else None,
            live=not snapshot.is_terminal,
        )

    def queues(self) -> str:
        return render_template(
            "runlane/queues.html", page="queues", queues=self.runlane.list_queues()
        )

    def workers(self) -> str:
        stopped = request.args.get("stopped") == "1"
        return render_template(
            "runlane/workers.html",
            page="workers",
            workers=self.runlane.list_workers(include_stopped=stopped),
            include_stopped=stopped,
        )

    def schedules(self) -> str:
        return render_template(
            "runlane/schedules.html",
            page="schedules",
            schedules=self.runlane.list_schedules(),
            nonce=secrets.token_urlsafe(18),
        )

    # -- single-run actions ------------------------------------------------------------------

    def retry(self, run_id: str) -> Response:
        self.allowed("retry")
        key = _run_id(run_id)
        self.runlane.retry_run(key)
        return self.done("runlane.run", "retried", run_id=str(key))

    def cancel(self, run_id: str) -> Response:
        self.allowed("cancel")
        key = _run_id(run_id)
        result = self.runlane.cancel(key)
        if not result.changed:
            notice = "unchanged"
        elif result.status is RunStatus.CANCELLATION_REQUESTED:
            notice = "cancel_requested"
        else:
            notice = "cancelled"
        return self.done("runlane.run", notice, run_id=str(key))

    # -- bulk actions --------------------------------------------------------------------------

    def bulk_action(self, source: Any) -> str:
        action = source.get("action", "")
        if action not in {"retry", "cancel"}:
            abort(400, "action must be retry or cancel")
        if not self.guard.allows(f"bulk_{action}"):
            abort(403, f"this console does not allow bulk {action} here")
        return str(action)

    def check_filters(self, filters: RunFilters) -> None:
        if not filters.any:
            raise ConfigurationError(
                "choose at least one filter (status, task, queue or a time) before a bulk "
                "action; the console does not act on every run at once"
            )

    def bulk_call(self, action: str, filters: RunFilters, **options: Any) -> Any:
        self.check_filters(filters)
        method = self.runlane.retry_runs if action == "retry" else self.runlane.cancel_runs
        return method(**attrs.asdict(filters, recurse=False), **options)

    def bulk_confirm(self) -> str:
        action = self.bulk_action(request.args)
        filters = _filters(request.args)
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
        counted, exact = self.storage().run_bulk_count_within(
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
        action = self.bulk_action(request.form)
        self.allowed(f"bulk_{action}")
        filters = _filters(request.form)
        result = self.bulk_call(action, filters, limit=BULK_LIMIT)
        values: dict[str, Any] = {
            **filters.args(),
            "done": "bulk",
            "changed": result.changed,
            "matched": result.matched,
        }
        return cast(
            Response,
            redirect(
                url_for("runlane.runs", **values),
                code=303,
            ),
        )

    # -- queues and schedules --------------------------------------------------------------------

    def named(self, field: str) -> str:
        value = request.form.get(field, "")
        if not value:
            abort(400, f"the form has no {field}")
        return value

    def pause_queue(self) -> Response:
        self.allowed("pause_queue")
        reason = _text(request.form, "reason")
        self.runlane.pause_queue(self.named("name"), reason=reason)
        return self.done("runlane.queues", "queue_paused")

    def resume_queue(self) -> Response:
        self.allowed("resume_queue")
        self.runlane.resume_queue(self.named("name"))
        return self.done("runlane.queues", "queue_resumed")

    def pause_schedule(self) -> Response:
        self.allowed("pause_schedule")
        self.runlane.pause_schedule(self.named("id"))
        return self.done("runlane.schedules", "schedule_paused")

    def resume_schedule(self) -> Response:
        self.allowed("resume_schedule")
        self.runlane.resume_schedule(self.named("id"))
        return self.done("runlane.schedules", "schedule_resumed")

    def trigger_schedule(self) -> Response:
        self.allowed("trigger_schedule")
        schedule_id = self.named("id")
        nonce = request.form.get("nonce", "")
        # the form's nonce makes a double submit (or a retried request) one run, not two;
        # bound to the schedule, so a nonce sent again for another schedule of the same task
        # makes that schedule's run instead of finding the first one (keys are per task).
        # The nonce holds no ':', so (nonce, schedule) pairs never share a key.
        key = f"console-{nonce}:{schedule_id}" if _NONCE.match(nonce) else None
        handle = self.runlane.trigger_schedule_now(schedule_id, idempotency_key=key)
        notice = "triggered" if handle.created else "triggered_before"
        return self.done("runlane.run", notice, run_id=str(handle.id))


def _error_page(error: Exception) -> tuple[str, int]:
    """The page of an error: what went wrong in words, never a traceback, never the
    database's address (the log has the details)."""
    if isinstance(error, HTTPException):
        code = error.code or 500
        title = {400: "Bad request", 403: "Not allowed", 404: "Not found"}.get(code, error.name)
        message = error.description or ""
        return _render_error(code, title, message)
    if isinstance(error, StorageUnavailable | SchemaNotMigrated):
        log.warning("web console: the database is unavailable: %s", error)
        return _render_error(
            503,
            "Database unavailable",
            "The console cannot reach runlane's database (or its schema is not migrated). "
            "Nothing is shown and nothing was changed; this page retries by itself. The "
            "server's log has the details.",
            refresh=True,
        )
    if isinstance(error, RunlaneClosed):
        return _render_error(
            503, "Console stopped", "The runtime behind this console was closed.", refresh=False
        )
    if isinstance(error, RunNotFound):
        return _render_error(404, "Run not found", str(error))
    if isinstance(error, RunStateConflict):
        return _render_error(409, "Not possible now", str(error))
    if isinstance(error, ConfigurationError):
        return _render_error(400, "Bad request", str(error))
    if isinstance(error, RunlaneError):
        log.error("web console: %s", error)
        return _render_error(500, "Error", "runlane reported an error; the server's log has it.")
    log.exception("web console: unexpected error")
    return _render_error(500, "Error", "The console failed; the server's log has the details.")


def _render_error(code: int, title: str, message: str, *, refresh: bool = False) -> tuple[str, int]:
    return (
        render_template(
            "runlane/error.html",
            page="error",
            code=code,
            title=title,
            message=message,
            retry=refresh,
        ),
        code,
    )


def make_app(runlane: Runlane, authorize: Authorize | None) -> Flask:
    """A Flask application serving the console at its root."""
    app = Flask("runlane.web", static_folder=None)
    app.register_blueprint(make_blueprint(runlane, authorize))

    @app.after_request
    def headers(response: Response) -> Response:
        response.headers.setdefault(
            "Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'"
        )
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        return response

    return app
