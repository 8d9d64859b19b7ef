"""The console: a Flask blueprint over one :class:`~runlane.Runlane`, made of rooms.

Each room (``_pages.py``: the pages; ``_actions.py``: the actions; ...) is a class made with
the shared :class:`~runlane.web._console.Console` that lists its routes; :data:`ROOMS` names
them all, and :func:`make_blueprint` registers every route of every room. A new page or
action goes in a room of its own and one line here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from flask import Blueprint, Flask, Response, current_app, request, url_for

from runlane.errors import ConfigurationError
from runlane.models import RunStatus
from runlane.runtime import Runlane, acting_as
from runlane.toolkit import noun_for
from runlane.web._actions import BULK_COUNT_CAP, BULK_LIMIT, Actions
from runlane.web._audit import AuditRoom
from runlane.web._console import NOTICES, Console, Room
from runlane.web._errors import error_page
from runlane.web._find import Find
from runlane.web._login import EnvironmentLogin, Login
from runlane.web._metrics import Metrics
from runlane.web._over_time import OverTime
from runlane.web._pages import PAGE_SIZE, Pages
from runlane.web._present import ago, cut, duration, pretty, when
from runlane.web._security import CSRF_FIELD, Authorize, Guard
from runlane.web._selection import Selection

__all__ = ["BULK_COUNT_CAP", "BULK_LIMIT", "PAGE_SIZE", "ROOMS", "make_app", "make_blueprint"]

REFRESH_SECONDS = 10  # pages update in place this often (app.config RUNLANE_REFRESH_SECONDS)

# every room of the console, in the order its routes are registered
ROOMS: tuple[Callable[[Console], Room], ...] = (
    Pages,
    Find,
    Actions,
    Metrics,
    AuditRoom,
    Login,
    OverTime,
    Selection,
)


def make_blueprint(runlane: Runlane, authorize: Authorize | None) -> Blueprint:
    """The console as a blueprint named ``runlane``."""
    if not isinstance(runlane, Runlane):
        raise ConfigurationError(
            f"the web console needs a Runlane (made by create_runlane), got a "
            f"{type(runlane).__name__}"
        )
    console = Console(runlane, Guard(authorize))
    bp = Blueprint(
        "runlane",
        __name__,
        template_folder="templates",
        static_folder="static",
        static_url_path="/static",
    )
    for room in ROOMS:
        for rule, endpoint, methods, view in room(console).routes():
            acts = "POST" in methods  # recorded in the audit trail as authorize's identity
            bp.add_url_rule(
                rule, endpoint, _acting(console, view) if acts else view, methods=methods
            )

    def helpers() -> dict[str, Any]:
        return {
            "can": console.guard.allows,
            "read_only": console.guard.read_only(),
            "login": isinstance(console.guard.authorizer, EnvironmentLogin),
            "identity": console.guard.identity,
            "csrf_field": CSRF_FIELD,
            "csrf_token": console.guard.token,
            "when": when,
            "ago": ago,
            "duration": duration,
            "pretty": pretty,
            "cut": cut,
            "plural": noun_for,
            "notice": NOTICES.get(request.args.get("done", "")),
            "environment": runlane.environment,
            "statuses": [s.value for s in RunStatus],
            "refresh": current_app.config.get("RUNLANE_REFRESH_SECONDS", REFRESH_SECONDS),
            "shown_at": datetime.now(UTC),
        }

    def finish(response: Response) -> Response:
        return console.guard.finish(response, url_for("runlane.overview"))

    bp.context_processor(helpers)
    bp.after_request(finish)
    bp.register_error_handler(Exception, error_page)
    return bp


def _acting(console: Console, view: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(view)
    def acting(*args: Any, **kwargs: Any) -> Any:
        with acting_as(console.guard.identity, via="console"):
            return view(*args, **kwargs)

    return acting


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
