"""What every room of the console shares: the runtime, its guard, and the route shape.

A room (``_pages.py``, ``_actions.py``, ...) is a class made with the :class:`Console` that
lists its routes; ``_app.py`` registers the routes of every room in ``ROOMS`` on one
blueprint. A new page or action is a new room (or a route in one), not a new mixin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast

from flask import Response, abort, redirect, url_for

from runlane.runtime import Runlane
from runlane.storage import Storage
from runlane.web._security import Guard

__all__ = ["NOTICES", "Console", "Room", "Route"]

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
    "deleted": "The run was deleted.",
    "rescheduled": "The run's due time was moved.",
    "ran_now": "The run is due now.",
}

# (rule, endpoint, methods, view)
Route = tuple[str, str, list[str], Callable[..., Any]]


class Console:
    """The runtime and guard of one console, and the helpers its views share."""

    def __init__(self, runlane: Runlane, guard: Guard) -> None:
        self.runlane = runlane
        self.guard = guard

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
        """Post/redirect/get: to ``endpoint`` with one of the fixed notices."""
        return cast(Response, redirect(url_for(endpoint, done=notice, **values), code=303))


class Room(Protocol):
    """A part of the console: its routes."""

    def routes(self) -> Iterable[Route]: ...
