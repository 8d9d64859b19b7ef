"""runlane's figures for Prometheus: ``pip install 'runlane[metrics]'`` (prometheus-client).

A collector reads runlane's database at scrape time, so every process serving ``/metrics``
(the console, ``runlane web``, ``runlane metrics --bind HOST:PORT``, or your own registry)
reports the same figures. ``collector(runlane)`` is that collector, for a registry of your
own (``prometheus_client.REGISTRY.register(collector(runlane))``); ``exposition(runlane,
accept)`` is one scrape's body and content type; ``wsgi_app(runlane)`` serves it (what
``runlane metrics`` runs). See docs/observability.md for the metrics and their labels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from runlane.errors import ConfigurationError, RunlaneClosed, SchemaNotMigrated, StorageUnavailable
from runlane.runtime import Runlane

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

__all__ = ["MISSING", "available", "collector", "exposition", "unavailable", "wsgi_app"]

log = logging.getLogger("runlane.metrics")

# the one line said when prometheus-client is not installed
MISSING = "runlane's /metrics needs prometheus-client: pip install 'runlane[metrics]'"


def available() -> bool:
    """Whether prometheus-client is installed (the metrics extra)."""
    try:
        import prometheus_client  # noqa: F401, PLC0415 - optional
    except ImportError:
        return False
    return True


def collector(runlane: Runlane) -> Collector:
    """A prometheus_client collector of ``runlane``'s figures (read at each scrape). A
    ConfigurationError when prometheus-client is not installed."""
    if not isinstance(runlane, Runlane):
        raise ConfigurationError(
            f"runlane.metrics needs a Runlane (made by create_runlane), got a "
            f"{type(runlane).__name__}"
        )
    try:
        from runlane.metrics._collector import RunlaneCollector  # noqa: PLC0415 - optional
    except ImportError:
        raise ConfigurationError(MISSING) from None
    return RunlaneCollector(runlane)


def exposition(runlane: Runlane, accept: str | None = None) -> tuple[bytes, str]:
    """One scrape: (body, content type), in Prometheus's text format, or OpenMetrics when
    ``accept`` (the request's Accept header) asks for it. Raises what runlane's reads raise
    (:class:`~runlane.errors.StorageUnavailable` when the database cannot be reached)."""
    made = collector(runlane)
    from prometheus_client.exposition import choose_encoder  # noqa: PLC0415 - optional
    from prometheus_client.registry import CollectorRegistry  # noqa: PLC0415 - optional

    registry = CollectorRegistry(auto_describe=False)
    registry.register(made)
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


Respond = Callable[[str, list[tuple[str, str]]], Any]


def wsgi_app(runlane: Runlane) -> Callable[[dict[str, Any], Respond], Iterable[bytes]]:
    """A WSGI application answering ``/metrics`` (and ``/``, for a quick look) with one
    scrape; 503 with one line while the database cannot be read, 404 elsewhere."""
    collector(runlane)  # fails now, not at the first scrape, without prometheus-client

    def app(environ: dict[str, Any], start_response: Respond) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "/") not in {"/", "/metrics"}:
            return _plain(start_response, "404 Not Found", "not found: runlane serves /metrics")
        try:
            body, content_type = exposition(runlane, environ.get("HTTP_ACCEPT"))
        except (StorageUnavailable, SchemaNotMigrated, RunlaneClosed) as error:
            return _plain(start_response, "503 Service Unavailable", unavailable(error))
        start_response("200 OK", [("Content-Type", content_type)])
        return [body]

    return app


def unavailable(error: Exception) -> str:
    """The one line a scrape answers while runlane's database cannot be read (the log
    has the error)."""
    log.warning("metrics: runlane's database cannot be read: %s", error)
    if isinstance(error, RunlaneClosed):
        return "runlane's runtime behind /metrics was closed"
    return f"runlane's database cannot be read now ({type(error).__name__}); see the log"


def _plain(start_response: Respond, status: str, line: str) -> list[bytes]:
    start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
    return [line.encode() + b"\n"]
