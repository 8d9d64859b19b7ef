"""Finding runs in the console: the run-id box on every page (``/find``) and the runs page's
search (task and queue prefixes, the idempotency key, payload containment), which
``Runlane.list_runs`` serves within a budget of database time."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any, cast

import attrs
from flask import Response, abort, redirect, request, url_for

from runlane.errors import ConfigurationError
from runlane.toolkit import shown
from runlane.web._console import Console, Route
from runlane.web._filters import text_arg

__all__ = ["SEARCH_SECONDS", "Find", "RunSearchArgs", "run_search_args"]

# the database time one runs page may spend searching (a prefix, key or payload filter):
# within the 200 ms a page answers in; a search that needs more says how far back it looked
SEARCH_SECONDS = 0.1


class Find:
    """The run-id box."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def routes(self) -> Iterable[Route]:
        return (("/find", "find", ["GET"], self.find),)

    def find(self) -> Response:
        value = text_arg(request.args, "run")
        if value is None:
            abort(400, "paste a run id in the box (the 36 characters of its UUID)")
        try:
            key = uuid.UUID(value)
        except ValueError:
            abort(
                400,
                f"{shown(value, 60)} is not a run id: a run id is a UUID of 36 characters "
                "(a search by task, queue, key or payload is on the Runs page)",
            )
        return cast(Response, redirect(url_for("runlane.run", run_id=str(key)), code=303))


@attrs.frozen
class RunSearchArgs:
    """The runs page's search fields, as the query string gives them."""

    task_prefix: str | None
    queue_prefix: str | None
    idempotency_key: str | None
    payload: str | None  # the JSON text typed in the box

    @property
    def any(self) -> bool:
        return any(v is not None for v in attrs.astuple(self, recurse=False))

    def args(self) -> dict[str, str]:
        return {k: v for k, v in attrs.asdict(self, recurse=False).items() if v is not None}

    def keywords(self) -> dict[str, Any]:
        """As ``list_runs`` keywords."""
        contains = None
        if self.payload is not None:
            try:
                contains = json.loads(self.payload)
            except (ValueError, RecursionError) as exc:
                raise ConfigurationError(
                    f"payload contains: {shown(self.payload, 60)} is not JSON; type an object "
                    'such as {"customer": {"id": 7}}'
                ) from exc
        return {
            "task_prefix": self.task_prefix,
            "queue_prefix": self.queue_prefix,
            "idempotency_key": self.idempotency_key,
            "payload_contains": contains,
        }


def run_search_args(source: Any) -> RunSearchArgs:
    return RunSearchArgs(
        task_prefix=text_arg(source, "task_prefix"),
        queue_prefix=text_arg(source, "queue_prefix"),
        idempotency_key=text_arg(source, "idempotency_key"),
        payload=text_arg(source, "payload"),
    )
