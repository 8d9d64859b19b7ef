"""The console's ``/metrics`` room: one scrape of :mod:`runlane.metrics`, as plain text.

Without prometheus-client it answers 501 with the one line saying what to install; while
the database cannot be read, 503 with one line (a failed scrape, which Prometheus records as
``up == 0``). Never the console's HTML error page: a scraper reads the body as text.
"""

from __future__ import annotations

from collections.abc import Iterable

from flask import Response, request

from runlane.errors import RunlaneClosed, SchemaNotMigrated, StorageUnavailable
from runlane.metrics import MISSING, available, exposition, unavailable
from runlane.web._console import Console, Route

__all__ = ["Metrics"]


class Metrics:
    """``GET /metrics`` (endpoint ``runlane.metrics``)."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def routes(self) -> Iterable[Route]:
        return [("/metrics", "metrics", ["GET"], self.metrics)]

    def metrics(self) -> Response:
        if not available():
            return _line(MISSING, 501)
        try:
            body, content_type = exposition(self.console.runlane, request.headers.get("Accept"))
        except (StorageUnavailable, SchemaNotMigrated, RunlaneClosed) as error:
            return _line(unavailable(error), 503)
        return Response(body, status=200, content_type=content_type)


def _line(text: str, status: int) -> Response:
    return Response(text + "\n", status=status, content_type="text/plain; charset=utf-8")
