"""The console's bulk actions on selected runs: the runs list's ticked rows retried,
cancelled or deleted together. A GET confirms (how many of the selection the action applies
to, a reason field); the POST, with the CSRF token and ``authorize``'s ``bulk_<action>``,
acts through ``retry_runs``/``cancel_runs``/``delete_runs(run_ids=...)``: one audit record
counting the runs it changed. At most ``SELECTION_LIMIT`` ids a request."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any, cast

from flask import Response, redirect, render_template, request, url_for

from runlane._operator.bulk import as_run_ids, bulk_filter
from runlane.errors import ConfigurationError
from runlane.web._actions import bulk_action_arg, bulk_method, form_reason
from runlane.web._console import Console, Route

__all__ = ["SELECTION_LIMIT", "Selection"]

SELECTION_LIMIT = 100  # run ids one selection request takes (a runs page shows 50)


class Selection:
    """Retry, cancel or delete the selected runs."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.runlane = console.runlane

    def routes(self) -> Iterable[Route]:
        return (
            ("/runs/selected", "selection_confirm", ["GET"], self.confirm),
            ("/runs/selected", "selection_apply", ["POST"], self.apply),
        )

    def selected(self, source: Any) -> tuple[uuid.UUID, ...]:
        """The ticked runs' ids, in their order, each once; a clear error beyond the cap."""
        values = source.getlist("run_id")
        if not values:
            raise ConfigurationError("no runs are selected: tick the runs to act on first")
        if len(values) > SELECTION_LIMIT:
            raise ConfigurationError(
                f"{len(values):,} runs are selected, more than {SELECTION_LIMIT}: select "
                "fewer, or act by filter (Retry/Cancel/Delete matching runs)"
            )
        ids = as_run_ids(values)
        assert ids is not None  # values is a list
        return ids

    def confirm(self) -> str:
        action = bulk_action_arg(self.console, request.args)
        ids = self.selected(request.args)
        runs, _ = bulk_filter(action, self.runlane.environment, {"run_ids": ids})
        # a selection is read through the primary key: an exact count, no time budget
        matched = self.console.storage().run_bulk_count(runs, len(ids))
        return render_template(
            "runlane/selected.html",
            page="runs",
            action=action,
            ids=ids,
            matched=matched,
            applies=_either([s.value for s in runs.statuses]),
        )

    def apply(self) -> Response:
        action = bulk_action_arg(self.console, request.form)
        self.console.allowed(f"bulk_{action}")
        ids = self.selected(request.form)
        result = bulk_method(self.runlane, action)(run_ids=ids, reason=form_reason())
        values: dict[str, Any] = {"done": "bulk", "changed": result.changed, "matched": len(ids)}
        return cast(Response, redirect(url_for("runlane.runs", **values), code=303))


def _either(names: list[str]) -> str:
    """``names`` as the page says them: "failed or cancelled", "a, b or c"."""
    *rest, last = names
    return f"{', '.join(rest)} or {last}" if rest else last
