"""The console mounted in a FastAPI app with a2wsgi's WSGIMiddleware (what FastAPI documents
for WSGI apps; Starlette's own is deprecated), driven through FastAPI's TestClient as
tests/test_fastapi_example.py drives the example: the app's own middleware guards the mount,
pages, links and the stylesheet stay under the prefix, and an action passes only with the
console's CSRF token."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any, cast

from flask import Request

from runlane import queue
from runlane.web import create_app
from tests._optional import require
from tests.conftest import RunlaneFactory

require("fastapi")
require("httpx2")  # the client FastAPI's TestClient uses
require("a2wsgi")
from a2wsgi import WSGIMiddleware  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from fastapi import Request as ApiRequest  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from starlette.responses import Response  # noqa: E402

OPERATOR = {"x-operator": "ada"}  # what the app's own auth would check; here, a header


def operators_only(request: Request, action: str) -> bool:
    # the console's authorize reads the same request the mount was given
    return request.headers.get("x-operator") == "ada"


def test_the_console_under_a_fastapi_mount(make_runlane: RunlaneFactory) -> None:
    rl = make_runlane(queues=[queue("default", default=True), queue("mail")])
    api = FastAPI()

    @api.middleware("http")
    async def guard(
        request: ApiRequest, call_next: Callable[[ApiRequest], Awaitable[Response]]
    ) -> Response:
        # a mount is outside FastAPI's dependencies: the app's middleware guards it
        if request.url.path.startswith("/runlane") and "x-operator" not in request.headers:
            return JSONResponse({"detail": "sign in"}, status_code=401)
        return await call_next(request)

    @api.get("/health")
    def health() -> dict[str, bool]:
        return {"ok": True}

    # a2wsgi types the environ and the ASGI scope as TypedDicts, Flask and Starlette as
    # plain mappings: the same values, which mypy cannot match
    mounted: Any = WSGIMiddleware(cast(Any, create_app(rl, authorize=operators_only)))
    api.mount("/runlane", mounted)
    with TestClient(api) as client:
        assert client.get("/health").json() == {"ok": True}
        assert client.get("/runlane/queues").status_code == 401

        page = client.get("/runlane/queues", headers=OPERATOR)
        assert page.status_code == 200, page.text
        assert "content-security-policy" in page.headers
        links = re.findall(r'<a [^>]*href="(/[^"]*)"', page.text)
        assert links
        assert all(link.startswith("/runlane/") for link in links), links
        stylesheet = re.search(r'<link rel="stylesheet" href="([^"]+)"', page.text)
        assert stylesheet
        assert stylesheet.group(1).startswith("/runlane/")
        css = client.get(stylesheet.group(1), headers=OPERATOR)
        assert css.status_code == 200
        assert css.headers["content-type"].startswith("text/css")

        token = re.search(r'name="csrf_token" value="([0-9a-f]+)"', page.text)
        assert token, page.text
        pause = "/runlane/queues/pause"
        refused = client.post(pause, data={"name": "mail"}, headers=OPERATOR)
        assert refused.status_code == 403  # no token
        assert not next(q for q in rl.list_queues() if q.name == "mail").paused
        done = client.post(
            pause,
            data={"name": "mail", "csrf_token": token.group(1)},
            headers=OPERATOR,
            follow_redirects=False,
        )
        assert done.status_code in (302, 303), done.text
        assert done.headers["location"].startswith("/runlane/queues")
        assert next(q for q in rl.list_queues() if q.name == "mail").paused
        shown = client.get(done.headers["location"], headers=OPERATOR)
        assert "The queue is paused." in shown.text
        assert "resume-queue" in shown.text

        # an operator the console's authorize does not know sees no button and may not act
        other = {"x-operator": "eve"}
        page = client.get("/runlane/queues", headers=other)
        assert "resume-queue" not in page.text
        refused = client.post(
            "/runlane/queues/resume", data={"name": "mail", "csrf_token": token.group(1)},
            headers=other,
        )  # fmt: skip
        assert refused.status_code == 403
        assert next(q for q in rl.list_queues() if q.name == "mail").paused
