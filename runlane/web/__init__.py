"""runlane's web console: ``pip install 'runlane[web]'``.

``create_app(runlane)`` is a WSGI application (Flask) serving the console at its root;
``blueprint(runlane)`` mounts it in an application of your own under a prefix
(``app.register_blueprint(blueprint(runlane), url_prefix="/runlane")``). ``runlane web``
serves it with waitress. Pages: overview, runs, a run, queues, workers, schedules (see
docs/console.md).

The console is read-only unless ``authorize(request, action)`` allows an action (True, or
the identity acting, recorded in the audit trail); actions are named in :data:`ACTIONS`.
``runlane web`` acts with a token or basic auth from the environment
(:func:`environment_login`). Every POST carries a CSRF token, every stored value is
escaped, every response has a Content-Security-Policy without inline scripts, and no page
uses an external asset.
"""

from __future__ import annotations

from flask import Blueprint, Flask

from runlane.runtime import Runlane
from runlane.web._app import make_app, make_blueprint
from runlane.web._login import EnvironmentLogin, environment_login
from runlane.web._security import ACTIONS, CONTENT_SECURITY_POLICY, Authorize

__all__ = [
    "ACTIONS",
    "CONTENT_SECURITY_POLICY",
    "Authorize",
    "EnvironmentLogin",
    "blueprint",
    "create_app",
    "environment_login",
]


def create_app(runlane: Runlane, *, authorize: Authorize | None = None) -> Flask:
    """The console as a WSGI application (a Flask app) serving ``runlane`` at its root.

    ``authorize(request, action)`` is asked before every action (one of :data:`ACTIONS`) and
    whether to show its button; without it the console is read-only. CSRF tokens are signed
    with ``app.secret_key`` when you set one (do, when several processes serve the console
    behind one address), else with a random key made now. The app does not own ``runlane``:
    close it yourself."""
    return make_app(runlane, authorize)


def blueprint(runlane: Runlane, *, authorize: Authorize | None = None) -> Blueprint:
    """The console as a Flask blueprint (named ``runlane``) to mount in your application:
    ``app.register_blueprint(blueprint(runlane, authorize=...), url_prefix="/runlane")``.
    ``authorize`` and the CSRF key as for :func:`create_app` (the key is your app's
    ``secret_key`` when set)."""
    return make_blueprint(runlane, authorize)
