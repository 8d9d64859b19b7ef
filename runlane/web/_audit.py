"""The console's audit trail page and the actions it adds: delete a terminal run, run a
delayed or retrying run now or at another time (reschedule), and the confirmation a
running run's cancel asks for. Each action is a POST carrying the CSRF token, allowed by
``authorize`` (``delete``, ``reschedule``, ``cancel``), recorded in the audit trail with
the identity ``authorize`` returned and the reason given in its form."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from flask import Response, abort, render_template, request

from runlane._operator.bulk import parse_filter_time
from runlane.models import RunStatus
from runlane.web._console import Console, Route
from runlane.web._filters import run_id_arg, text_arg

__all__ = ["AUDIT_PAGE_SIZE", "AuditRoom"]

AUDIT_PAGE_SIZE = 50


class AuditRoom:
    """``/audit``, ``/runs/<id>/delete``, ``/runs/<id>/reschedule`` and the cancel
    confirmation ``/runs/<id>/cancel`` (GET)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.runlane = console.runlane

    def routes(self) -> Iterable[Route]:
        return (
            ("/audit", "audit", ["GET"], self.audit),
            ("/runs/<run_id>/delete", "delete", ["POST"], self.delete),
            ("/runs/<run_id>/reschedule", "reschedule", ["POST"], self.reschedule),
            ("/runs/<run_id>/cancel", "cancel_confirm", ["GET"], self.cancel_confirm),
        )

    def audit(self) -> str:
        page = self.runlane.list_audit(
            limit=AUDIT_PAGE_SIZE, cursor=text_arg(request.args, "cursor")
        )
        return render_template(
            "runlane/audit.html", page="audit", records=page.items, next_cursor=page.next_cursor
        )

    def delete(self, run_id: str) -> Response:
        self.console.allowed("delete")
        key = run_id_arg(run_id)
        self.runlane.delete_run(key, reason=text_arg(request.form, "reason"))
        return self.console.done("runlane.runs", "deleted")

    def reschedule(self, run_id: str) -> Response:
        self.console.allowed("reschedule")
        key = run_id_arg(run_id)
        run_at = self._run_at()
        self.runlane.reschedule_run(key, run_at=run_at, reason=text_arg(request.form, "reason"))
        return self.console.done(
            "runlane.run", "ran_now" if run_at is None else "rescheduled", run_id=str(key)
        )

    def _run_at(self) -> datetime | None:
        if request.form.get("now"):
            return None
        text = text_arg(request.form, "run_at")
        if text is None:
            abort(400, "give the new due time (UTC), or choose Run now")
        # a datetime-local field gives no offset: the console's times are UTC
        return parse_filter_time("the new due time", text, naive_is_utc=True)

    def cancel_confirm(self, run_id: str) -> str:
        run = self.runlane.get_run(run_id_arg(run_id))
        if run.status is not RunStatus.RUNNING:
            abort(409, f"run {run.id} is {run.status.value}: only a running run asks first")
        return render_template("runlane/cancel_confirm.html", page="runs", run=run)
