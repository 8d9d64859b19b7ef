"""The console's WSGI app called from a Django view: the request's environ with
``SCRIPT_NAME`` and ``PATH_INFO`` moved to the mount's prefix, the response passed back as it
streams (server-sent events included), its cookies as Django's."""

from __future__ import annotations

import io
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from http.cookies import SimpleCookie
from typing import Any

from django.http import HttpRequest, HttpResponseBadRequest, StreamingHttpResponse
from django.http.request import RawPostDataException
from django.http.response import HttpResponseBase
from flask import Flask, Request

from runlane.cli import load_app
from runlane.integrations.django._settings import (
    STAFF,
    SUPERUSER,
    actions_rule,
    app_spec,
    console_config,
    console_key,
)
from runlane.web import create_app

__all__ = ["USER_KEY", "authorize_for", "call_console", "console_app"]

# where the console's authorize finds the Django user in the environ it is given
USER_KEY = "runlane.django.user"

# hop-by-hop headers (PEP 3333): the server's to send, never the app's
_HOP_BY_HOP = frozenset(
    ("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
     "trailers", "transfer-encoding", "upgrade")
)  # fmt: skip

_lock = threading.Lock()
_app: Flask | None = None


def console_app() -> Flask:
    """The console over ``RUNLANE_APP``'s runtime, made on the first request of this
    process (the runtime is the project's: it is not closed here)."""
    global _app  # noqa: PLW0603 - one console per process, made once
    with _lock:
        if _app is None:
            rule = actions_rule()
            app = create_app(
                load_app(app_spec()), authorize=None if rule is None else authorize_for(rule)
            )
            app.secret_key = console_key()
            app.config.update(console_config())
            _app = app
        return _app


def authorize_for(rule: str) -> Callable[[Request, str], bool | str]:
    """The console's ``authorize`` for ``RUNLANE_CONSOLE_ACTIONS = rule``: asked about the
    Django user the view put in the environ (active staff only, whatever the rule). A user
    who may act is named by their username: the actor of the console's audit records."""

    def authorize(request: Request, action: str) -> bool | str:
        user = request.environ.get(USER_KEY)
        if user is None or not (user.is_active and user.is_staff):
            return False
        if rule == SUPERUSER:
            allowed = bool(user.is_superuser)
        else:
            allowed = rule == STAFF or bool(user.has_perm(rule))
        return (str(user.get_username()) or True) if allowed else False

    authorize.__qualname__ = f"django users ({rule})"
    return authorize


def _wsgi_text(text: str) -> str:
    """A decoded path as WSGI carries it: its UTF-8 bytes as latin-1."""
    return text.encode("utf-8").decode("latin-1")


def _environ(request: HttpRequest, path: str, body: bytes) -> dict[str, Any]:
    environ: dict[str, Any] = dict(request.META)
    mount = request.path[: len(request.path) - len(path)] if path else request.path
    environ.update(
        {
            "SCRIPT_NAME": _wsgi_text(mount.rstrip("/")),
            "PATH_INFO": _wsgi_text("/" + path),
            "CONTENT_LENGTH": str(len(body)),
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": environ.get("wsgi.errors", sys.stderr),
            "wsgi.url_scheme": request.scheme,
            "wsgi.version": (1, 0),
            "wsgi.multithread": True,
            "wsgi.multiprocess": True,
            "wsgi.run_once": False,
            USER_KEY: getattr(request, "user", None),
        }
    )
    environ.pop("HTTP_TRANSFER_ENCODING", None)  # the body is read whole: its length is known
    return environ


class _Body:
    """The WSGI app's iterable as Django streams it: what it wrote before, then its chunks;
    closed (the app's own close) when Django closes the response."""

    def __init__(self, head: list[bytes], rest: Iterator[bytes], source: Iterable[bytes]):
        self._head = head
        self._rest = rest
        self._source = source

    def __iter__(self) -> Iterator[bytes]:
        yield from self._head
        yield from self._rest

    def close(self) -> None:
        close = getattr(self._source, "close", None)
        if close is not None:
            close()


def call_console(request: HttpRequest, path: str) -> HttpResponseBase:
    """``request`` answered by the console mounted at the part of its path before ``path``."""
    try:
        body = request.body
    except RawPostDataException:  # a multipart form read before: the console sends none
        return HttpResponseBadRequest("the console's forms are urlencoded, not multipart")
    started: list[Any] = []
    written: list[bytes] = []

    def start_response(
        status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], None]:
        if exc_info is not None and started:
            raise exc_info[1].with_traceback(exc_info[2])
        started[:] = [status, headers]
        return written.append

    source = console_app()(_environ(request, path, body), start_response)
    rest = iter(source)
    head = written
    if not started:  # an app may call start_response with its first chunk (PEP 3333)
        head = [*written, *(chunk for chunk in [next(rest, b"")] if chunk)]
    status, headers = started
    response = StreamingHttpResponse(
        _Body(head, rest, source), status=int(status[:3]), reason=status[4:] or None
    )
    for name, value in headers:
        lowered = name.lower()
        if lowered == "set-cookie":
            cookie: SimpleCookie = SimpleCookie()
            cookie.load(value)
            for key, morsel in cookie.items():
                response.cookies[key] = morsel
        elif lowered in _HOP_BY_HOP:
            continue
        elif lowered != "content-type" and name in response.headers:
            response.headers[name] = f"{response.headers[name]}, {value}"
        else:
            response.headers[name] = value
    return response
