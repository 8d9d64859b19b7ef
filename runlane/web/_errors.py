"""The console's error pages: what went wrong in words, never a traceback, never the
database's address (the log has the details)."""

from __future__ import annotations

import logging

from flask import render_template
from werkzeug.exceptions import HTTPException

from runlane.errors import (
    ConfigurationError,
    RunlaneClosed,
    RunlaneError,
    RunNotFound,
    RunStateConflict,
    SchemaNotMigrated,
    StorageUnavailable,
)

__all__ = ["error_page"]

log = logging.getLogger("runlane.web")


def error_page(error: Exception) -> tuple[str, int]:
    """The page of an error, and its status code."""
    if isinstance(error, HTTPException):
        code = error.code or 500
        title = {400: "Bad request", 403: "Not allowed", 404: "Not found"}.get(code, error.name)
        message = error.description or ""
        return _render(code, title, message)
    if isinstance(error, StorageUnavailable | SchemaNotMigrated):
        log.warning("web console: the database is unavailable: %s", error)
        return _render(
            503,
            "Database unavailable",
            "The console cannot reach runlane's database (or its schema is not migrated). "
            "Nothing is shown and nothing was changed; this page retries by itself. The "
            "server's log has the details.",
            refresh=True,
        )
    if isinstance(error, RunlaneClosed):
        return _render(
            503, "Console stopped", "The runtime behind this console was closed.", refresh=False
        )
    if isinstance(error, RunNotFound):
        return _render(404, "Run not found", str(error))
    if isinstance(error, RunStateConflict):
        return _render(409, "Not possible now", str(error))
    if isinstance(error, ConfigurationError):
        return _render(400, "Bad request", str(error))
    if isinstance(error, RunlaneError):
        log.error("web console: %s", error)
        return _render(500, "Error", "runlane reported an error; the server's log has it.")
    log.exception("web console: unexpected error")
    return _render(500, "Error", "The console failed; the server's log has the details.")


def _render(code: int, title: str, message: str, *, refresh: bool = False) -> tuple[str, int]:
    return (
        render_template(
            "runlane/error.html",
            page="error",
            code=code,
            title=title,
            message=message,
            retry=refresh,
        ),
        code,
    )
