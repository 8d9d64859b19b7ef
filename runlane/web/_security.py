"""The console's guards: who may act (``authorize``), the CSRF token every POST carries, and
the security headers of every response.

CSRF: a random value is kept in a cookie of the console's own (HttpOnly, SameSite=Strict, on
the console's path; Secure over HTTPS, then named ``__Host-runlane_csrf`` when that path is
``/``); every form carries an HMAC of it and, once logged in to ``runlane web``, of the login
(its session's nonce, or the basic-auth user). A POST whose token is missing or does not
match is refused with 403. Another site can neither read the cookie nor compute the token, a
token copied from one browser is worthless with another's cookie, and one read before the
login (from a cookie planted by someone else) is worthless after it. The HMAC key is the
Flask application's ``secret_key`` when one is set (set it when several processes serve one
console), else a random key made when the console is built.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from flask import Request, Response, current_app, g, request, url_for

from runlane.errors import ConfigurationError

__all__ = [
    "ACTIONS",
    "CONTENT_SECURITY_POLICY",
    "CSRF_COOKIE",
    "CSRF_FIELD",
    "Authorize",
    "Guard",
    "cookie_name",
]

log = logging.getLogger("runlane.web")

# True allows, a non-empty string allows and names who acts (the audit trail's actor),
# anything else refuses
Authorize = Callable[[Request, str], bool | str]

# every action the console can take; authorize(request, action) is asked with one of these
ACTIONS = (
    "retry",
    "cancel",
    "bulk_retry",
    "bulk_cancel",
    "bulk_delete",
    "pause_queue",
    "resume_queue",
    "pause_schedule",
    "resume_schedule",
    "trigger_schedule",
    "delete",
    "reschedule",
)

CSRF_COOKIE = "runlane_csrf"
CSRF_FIELD = "csrf_token"

# no inline script or style, nothing from another origin, no framing
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)

_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


@runtime_checkable
class BoundLogin(Protocol):
    """An authorize that binds the CSRF token to its login (``runlane web``'s)."""

    def csrf_binding(self, request: Request) -> str:
        """What names this request's login ("" when it has none)."""
        ...


def cookie_name(name: str, path: str) -> str:
    """``name`` as this request sets and reads it: ``__Host-`` first when the request came over
    HTTPS and the cookie's path is ``/`` (the browser then keeps it to this host, Secure, and
    a neighbour on the same site cannot plant one)."""
    return f"__Host-{name}" if request.is_secure and path == "/" else name


class Guard:
    """The authorize callable, and the CSRF key of one console."""

    def __init__(self, authorize: Authorize | None) -> None:
        if authorize is not None and not callable(authorize):
            raise ConfigurationError(
                f"authorize must be a callable (request, action) -> bool or an identity, or "
                f"None for a read-only console; got a {type(authorize).__name__}"
            )
        self._authorize = authorize
        self._own_key = secrets.token_bytes(32)

    @property
    def authorizer(self) -> Authorize | None:
        return self._authorize

    def identity(self) -> str | None:
        """Who this request acts as: the name ``authorize`` returned, if it returned one."""
        name = g.get("runlane_identity")
        return name if isinstance(name, str) else None

    def allows(self, action: str) -> bool:
        """Whether this request may take ``action`` (answered once per request and action).
        An authorize callable that raises denies, and is logged with its traceback: any
        exception, also ``SystemExit``, ``GeneratorExit`` and a ``KeyboardInterrupt`` raised
        on a request thread (signals reach only the main thread, so that one is the hook's
        own), which would otherwise escape the request and leave its client without an
        answer. A ``KeyboardInterrupt`` on the main thread, a Ctrl-C under a single-threaded
        server, goes on: it stops the server."""
        if self._authorize is None:
            return False
        asked: dict[str, bool] = g.setdefault("runlane_allowed", {})
        if action not in asked:
            try:
                answer = self._authorize(request, action)
                named = isinstance(answer, str) and bool(answer.strip())
                asked[action] = answer is True or named
                if named:
                    g.runlane_identity = answer
            except BaseException as exc:
                ctrl_c = isinstance(exc, KeyboardInterrupt)
                if ctrl_c and threading.current_thread() is threading.main_thread():
                    raise
                log.exception("authorize(request, %r) raised: the action is refused", action)
                asked[action] = False
        return asked[action]

    def read_only(self) -> bool:
        return self._authorize is None

    # -- CSRF ------------------------------------------------------------------------------

    def _key(self) -> bytes:
        configured = current_app.secret_key
        if isinstance(configured, str) and configured:
            return configured.encode()
        if isinstance(configured, bytes) and configured:
            return configured
        return self._own_key

    def _binding(self) -> str:
        """The login's binding, asked once a request (a page signs a token per form)."""
        binding = g.get("runlane_csrf_binding")
        if binding is None:
            login = self._authorize
            binding = login.csrf_binding(request) if isinstance(login, BoundLogin) else ""
            g.runlane_csrf_binding = binding
        return str(binding)

    def _sign(self, seed: str) -> str:
        binding = self._binding()
        message = f"{seed}\n{binding}" if binding else seed
        return hmac.new(self._key(), message.encode(), hashlib.sha256).hexdigest()

    def _cookie(self) -> str:
        return cookie_name(CSRF_COOKIE, url_for("runlane.overview"))  # the console's path

    def _seed(self) -> str:
        seed = g.get("runlane_csrf_seed")
        if seed is None:
            given = request.cookies.get(self._cookie(), "")
            seed = given if 20 <= len(given) <= 100 else secrets.token_urlsafe(32)
            g.runlane_csrf_seed = seed
        return str(seed)

    def token(self) -> str:
        """The token this browser's forms carry (for its login, once logged in)."""
        return self._sign(self._seed())

    def token_valid(self) -> bool:
        given = request.form.get(CSRF_FIELD, "")
        cookie = request.cookies.get(self._cookie(), "")
        if not given or not cookie:
            return False
        return hmac.compare_digest(given, self._sign(cookie))

    def finish(self, response: Response, cookie_path: str) -> Response:
        """Security headers on every response; the CSRF cookie when this request made one."""
        for name, value in _HEADERS.items():
            response.headers.setdefault(name, value)
        seed = g.get("runlane_csrf_seed")
        name = cookie_name(CSRF_COOKIE, cookie_path)
        if seed is not None and request.cookies.get(name) != seed:
            response.set_cookie(
                name,
                seed,
                path=cookie_path,
                httponly=True,
                samesite="Strict",
                secure=request.is_secure,
            )
        return response
