"""``runlane web``'s credentials: the console acts only for a browser that presents them.

From the environment: ``RUNLANE_WEB_TOKEN`` (a token typed once into the login page, which
then keeps a session cookie), or ``RUNLANE_WEB_USER`` and ``RUNLANE_WEB_PASSWORD`` (HTTP
basic auth, which the browser asks for at ``/login``); without them the console is
read-only. Comparisons are constant-time. The session cookie holds a random nonce and an
HMAC of it keyed by the token, so it reveals nothing, and changing the token ends every
session. The identity recorded in the audit trail is ``token`` or the basic-auth user.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping
from typing import cast

import attrs
from flask import Request, Response, abort, redirect, render_template, request, url_for

from runlane.errors import ConfigurationError
from runlane.web._console import Console, Route

__all__ = ["SESSION_COOKIE", "EnvironmentLogin", "Login", "environment_login"]

SESSION_COOKIE = "runlane_session"
TOKEN_IDENTITY = "token"
_MIN_SECRET = 8  # characters of a token or password: a typo-sized secret is refused
_SESSION_SECONDS = 12 * 3600


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


@attrs.frozen(repr=False)  # no secret in a repr
class EnvironmentLogin:
    """An ``authorize`` for the console: every action, for a browser that logged in."""

    token: str | None
    user: str | None
    password: str | None

    def __call__(self, request: Request, action: str) -> bool | str:
        if self.user is not None and self.password is not None and self._basic(request):
            return self.user
        if self.token is not None and self.session_valid(request.cookies.get(SESSION_COOKIE)):
            return TOKEN_IDENTITY
        return False

    def _basic(self, request: Request) -> bool:
        auth = request.authorization
        if auth is None or self.user is None or self.password is None:
            return False
        # both compared, whichever fails first: no timing says which was wrong
        return _same(auth.username or "", self.user) & _same(auth.password or "", self.password)

    def _sign(self, nonce: str) -> str:
        assert self.token is not None
        return hmac.new(self.token.encode(), nonce.encode(), hashlib.sha256).hexdigest()

    def session(self) -> str:
        nonce = secrets.token_urlsafe(24)
        return f"{nonce}.{self._sign(nonce)}"

    def session_valid(self, cookie: str | None) -> bool:
        if self.token is None or not cookie or cookie.count(".") != 1:
            return False
        nonce, signature = cookie.split(".")
        return hmac.compare_digest(signature, self._sign(nonce))

    def token_given(self, given: str) -> bool:
        return self.token is not None and _same(given, self.token)


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
            page = render_template("runlane/login.html", page="login", basic=True, failed=False)
            return page, 401, {"WWW-Authenticate": 'Basic realm="runlane", charset="UTF-8"'}
        return render_template("runlane/login.html", page="login", basic=False, failed=False)

    def submit(self) -> Response | tuple[str, int]:
        assert self.login is not None
        if not self.console.guard.token_valid() or not self.login.token_given(
            request.form.get("token", "")
        ):
            page = render_template("runlane/login.html", page="login", basic=False, failed=True)
            return page, 403
        response = self._home()
        response.set_cookie(
            SESSION_COOKIE,
            self.login.session(),
            max_age=_SESSION_SECONDS,
            path=url_for("runlane.overview"),
            httponly=True,
            samesite="Strict",
            secure=request.is_secure,
        )
        return response

    def logout(self) -> Response:
        if not self.console.guard.token_valid():
            abort(403, "the form's CSRF token is missing or does not match: reload the page")
        response = self._home()
        response.delete_cookie(SESSION_COOKIE, path=url_for("runlane.overview"))
        return response
