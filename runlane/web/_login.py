"""``runlane web``'s credentials: the console acts only for a browser that presents them.

From the environment: ``RUNLANE_WEB_TOKEN`` (a token typed once into the login page, which
then keeps a session cookie), or ``RUNLANE_WEB_USER`` and ``RUNLANE_WEB_PASSWORD`` (HTTP
basic auth, which the browser asks for at ``/login``); without them the console is
read-only. Comparisons are constant-time. The identity recorded in the audit trail is
``token`` or the basic-auth user.

A session is a random nonce, its issue time and an HMAC of both keyed by the token, so the
cookie reveals nothing; the process keeps the nonces it issued, and honours a cookie only
while its nonce is kept and younger than 12 hours. Logging out forgets the nonce, so a copy
of the cookie is worthless at once; a restart forgets them all (every browser logs in
again), and so does changing the token. The sessions live in the one process that made
them: an app of yours served by several processes needs its own ``authorize``.

Failed logins are logged (one line: the client's address, never the text tried), and a
client that fails three times in a row waits before its next try is even looked at: 1 s,
then twice as long each time, up to a minute (429 with Retry-After).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import attrs
from flask import Request, Response, abort, redirect, render_template, request, url_for

from runlane.errors import ConfigurationError
from runlane.web._console import Console, Route
from runlane.web._security import cookie_name

__all__ = ["SESSION_COOKIE", "EnvironmentLogin", "Login", "environment_login"]

log = logging.getLogger("runlane.web")

SESSION_COOKIE = "runlane_session"
TOKEN_IDENTITY = "token"
_MIN_SECRET = 8  # characters of a token or password: a typo-sized secret is refused
_SESSION_SECONDS = 12 * 3600
_MAX_SESSIONS = 10_000  # live sessions kept; past it the oldest is forgotten
_FREE_FAILURES = 3  # failed logins in a row from one client before it must wait
_MAX_WAIT = 60.0  # seconds: the longest wait a client's failures earn
_FORGET_FAILURES = 900.0  # seconds after its last failure a client starts afresh
_MAX_CLIENTS = 10_000  # clients whose failures are kept; past it the oldest is forgotten


def _secret(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    if value is None:
        return None
    if len(value.strip()) < _MIN_SECRET:
        raise ConfigurationError(
            f"{name} is set but {'empty' if not value.strip() else 'too short'}: give at least "
            f"{_MIN_SECRET} characters (a random one: python -c 'import secrets; "
            f"print(secrets.token_urlsafe(24))'), or unset it for a read-only console"
        )
    return value


def environment_login(environ: Mapping[str, str]) -> EnvironmentLogin | None:
    """The credentials ``environ`` gives the console, or None (read-only)."""
    token = _secret(environ, "RUNLANE_WEB_TOKEN")
    user = environ.get("RUNLANE_WEB_USER")
    password = _secret(environ, "RUNLANE_WEB_PASSWORD")
    if user is not None and not user.strip():
        raise ConfigurationError("RUNLANE_WEB_USER is set but empty: give a user name or unset it")
    if user is not None and ":" in user:
        # basic auth splits "user:password" at the first colon: such a user never logs in
        raise ConfigurationError(
            "RUNLANE_WEB_USER contains ':', which HTTP basic auth cannot carry in a user "
            "name: choose a name without it"
        )
    if (user is None) != (password is None):
        raise ConfigurationError(
            "basic auth needs both RUNLANE_WEB_USER and RUNLANE_WEB_PASSWORD; one is not set"
        )
    if token is None and user is None:
        return None
    return EnvironmentLogin(token=token, user=user, password=password)


def _same(given: str, expected: str) -> bool:
    # digests first: compare_digest is constant-time only for inputs of one length
    return hmac.compare_digest(
        hashlib.sha256(given.encode()).digest(), hashlib.sha256(expected.encode()).digest()
    )


class _Sessions:
    """The nonces of this process's live sessions, with their issue times."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._issued: dict[str, int] = {}

    def add(self, nonce: str, issued: int) -> None:
        with self._lock:
            self._issued[nonce] = issued
            while len(self._issued) > _MAX_SESSIONS:
                del self._issued[next(iter(self._issued))]

    def issued(self, nonce: str) -> int | None:
        with self._lock:
            return self._issued.get(nonce)

    def drop(self, nonce: str) -> None:
        with self._lock:
            self._issued.pop(nonce, None)


class _Failures:
    """Failed logins in a row per client: (count, last failure, may try again at)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[str, tuple[int, float, float]] = {}

    def wait(self, client: str, now: float) -> float:
        """Seconds ``client`` must still wait before a login of its is looked at."""
        with self._lock:
            _, _, until = self._clients.get(client, (0, 0.0, 0.0))
        return max(until - now, 0.0)

    def failed(self, client: str, now: float) -> tuple[int, float]:
        """Count a failure of ``client``: its failures in a row, and the wait they earn."""
        with self._lock:
            count, last, _ = self._clients.pop(client, (0, 0.0, 0.0))
            count = count + 1 if now - last < _FORGET_FAILURES else 1
            wait = min(2.0 ** (count - _FREE_FAILURES), _MAX_WAIT) if count >= _FREE_FAILURES else 0
            self._clients[client] = (count, now, now + wait)
            while len(self._clients) > _MAX_CLIENTS:
                del self._clients[next(iter(self._clients))]
        return count, wait

    def succeeded(self, client: str) -> None:
        with self._lock:
            self._clients.pop(client, None)


@attrs.frozen(repr=False)  # no secret in a repr
class EnvironmentLogin:
    """An ``authorize`` for the console: every action, for a browser that logged in.
    ``clock`` (seconds since the epoch) dates sessions and failed logins."""

    token: str | None
    user: str | None
    password: str | None
    clock: Callable[[], float] = time.time
    _sessions: _Sessions = attrs.field(factory=_Sessions, init=False, eq=False)
    _failures: _Failures = attrs.field(factory=_Failures, init=False, eq=False)

    def __call__(self, request: Request, action: str) -> bool | str:
        if self._basic(request):
            return cast(str, self.user)
        if self._session_nonce(request) is not None:
            return TOKEN_IDENTITY
        return False

    def csrf_binding(self, request: Request) -> str:
        """What names this request's login: its session, else its basic-auth user."""
        nonce = self._session_nonce(request)
        if nonce is not None:
            return f"session:{nonce}"
        return f"user:{self.user}" if self._basic(request) else ""

    def _basic(self, request: Request) -> bool:
        auth = request.authorization
        if auth is None or self.user is None or self.password is None:
            return False
        # both compared, whichever fails first: no timing says which was wrong
        return _same(auth.username or "", self.user) & _same(auth.password or "", self.password)

    def _sign(self, text: str) -> str:
        assert self.token is not None
        return hmac.new(self.token.encode(), text.encode(), hashlib.sha256).hexdigest()

    def session(self) -> str:
        """A new session's cookie value, kept as live until it ends."""
        nonce, issued = secrets.token_urlsafe(24), int(self.clock())
        self._sessions.add(nonce, issued)
        return f"{nonce}.{issued}.{self._sign(f'{nonce}.{issued}')}"

    def session_valid(self, cookie: str | None) -> bool:
        return self._nonce(cookie) is not None

    def end_session(self, cookie: str | None) -> None:
        """Forget the session of ``cookie``: a copy of it is worthless from now on."""
        nonce = self._nonce(cookie)
        if nonce is not None:
            self._sessions.drop(nonce)

    def _nonce(self, cookie: str | None) -> str | None:
        if self.token is None or not cookie or cookie.count(".") != 2:
            return None
        nonce, issued_text, signature = cookie.split(".")
        if not hmac.compare_digest(signature, self._sign(f"{nonce}.{issued_text}")):
            return None
        issued = self._sessions.issued(nonce)
        if issued is None or str(issued) != issued_text:
            return None  # logged out, issued before a restart, or forgotten
        if not issued <= self.clock() < issued + _SESSION_SECONDS:
            self._sessions.drop(nonce)
            return None
        return nonce

    def _session_nonce(self, request: Request) -> str | None:
        return self._nonce(request.cookies.get(session_cookie()))

    def token_given(self, given: str) -> bool:
        return self.token is not None and _same(given, self.token)

    def login_wait(self, client: str) -> float:
        return self._failures.wait(client, self.clock())

    def login_failed(self, client: str) -> tuple[int, float]:
        return self._failures.failed(client, self.clock())

    def login_succeeded(self, client: str) -> None:
        self._failures.succeeded(client)


def session_cookie() -> str:
    """The session cookie's name for this request (``__Host-`` first over HTTPS at ``/``)."""
    return cookie_name(SESSION_COOKIE, url_for("runlane.overview"))


def _page(*, basic: bool = False, failed: bool = False, wait: int | None = None) -> str:
    """The login page: for basic auth, after a failed try, or while a client must wait."""
    return render_template(
        "runlane/login.html", page="login", basic=basic, failed=failed, wait=wait
    )


def _cookie_options() -> dict[str, Any]:
    """The session cookie's attributes, as it is set and as it is deleted."""
    return {
        "path": url_for("runlane.overview"),
        "httponly": True,
        "samesite": "Strict",
        "secure": request.is_secure,
    }


class Login:
    """``/login`` and ``/logout`` when the console's authorize is ``runlane web``'s."""

    def __init__(self, console: Console) -> None:
        self.console = console
        authorizer = console.guard.authorizer
        self.login = authorizer if isinstance(authorizer, EnvironmentLogin) else None

    def routes(self) -> Iterable[Route]:
        if self.login is None:
            return ()
        return (
            ("/login", "login", ["GET"], self.form),
            ("/login", "login_submit", ["POST"], self.submit),
            ("/logout", "logout", ["POST"], self.logout),
        )

    def _home(self) -> Response:
        return cast(Response, redirect(url_for("runlane.overview"), code=303))

    def form(self) -> Response | str | tuple[str, int, dict[str, str]]:
        assert self.login is not None
        if self.login(request, "login"):
            return self._home()
        if self.login.token is None:  # basic auth only: the browser asks for it
            challenge = {"WWW-Authenticate": 'Basic realm="runlane", charset="UTF-8"'}
            return _page(basic=True), 401, challenge
        return _page()

    def submit(self) -> Response | tuple[str, int] | tuple[str, int, dict[str, str]]:
        assert self.login is not None
        client = request.remote_addr or "an unknown address"
        wait = self.login.login_wait(client)
        if wait > 0:  # not even looked at: a guesser learns nothing while it waits
            log.warning("a login at /login from %s refused: it must wait %.0f s", client, wait)
            seconds = math.ceil(wait)
            return _page(wait=seconds), 429, {"Retry-After": str(seconds)}
        if not self.console.guard.token_valid():
            return _page(failed=True), 403
        if not self.login.token_given(request.form.get("token", "")):
            count, wait = self.login.login_failed(client)
            log.warning(
                "a failed login at /login from %s (%d in a row%s)",
                client,
                count,
                f"; its next try waits {wait:.0f} s" if wait else "",
            )
            return _page(failed=True), 403
        self.login.login_succeeded(client)
        response = self._home()
        response.set_cookie(
            session_cookie(), self.login.session(), max_age=_SESSION_SECONDS, **_cookie_options()
        )
        return response

    def logout(self) -> Response:
        assert self.login is not None
        if not self.console.guard.token_valid():
            abort(403, "the form's CSRF token is missing or does not match: reload the page")
        self.login.end_session(request.cookies.get(session_cookie()))
        response = self._home()
        response.delete_cookie(session_cookie(), **_cookie_options())
        return response
