"""``runlane.integrations.sentry``: each attempt in its own Sentry scope
(``pip install 'runlane[sentry]'``).

::

    import sentry_sdk
    from runlane.integrations.sentry import sentry_scope

    sentry_sdk.init(dsn=...)  # its logging integration turns ERROR records into events
    runlane = create_runlane(..., middleware=[sentry_scope])

``sentry_scope`` is a middleware: every attempt runs in a fresh isolation scope (what a
handler sets with ``sentry_sdk.set_tag``, its breadcrumbs and its user never reach another
run's events, even from the same worker thread), tagged ``runlane.run_id``,
``runlane.task_id``, ``runlane.queue``, ``runlane.attempt`` and ``runlane.environment``, with
the same as the ``runlane`` context. A run that fails for good is logged at ERROR with its
traceback on logger ``runlane.worker`` inside that scope, so Sentry's logging integration
reports it as an event carrying those tags; a retried failure, logged at WARNING, becomes a
breadcrumb.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

try:
    import sentry_sdk
except ImportError as exc:  # pragma: no cover - the sentry extra is not installed
    raise ImportError(
        "runlane.integrations.sentry needs sentry-sdk: pip install 'runlane[sentry]'"
    ) from exc

from runlane.context import RunContext

__all__ = ["sentry_scope"]


@contextmanager
def sentry_scope(context: RunContext) -> Iterator[None]:
    """The attempt in a fresh Sentry isolation scope tagged with its run."""
    fields = {
        "run_id": str(context.run_id),
        "task_id": context.task_id,
        "queue": context.queue,
        "attempt": str(context.attempt),
        "environment": context.environment,
    }
    with sentry_sdk.isolation_scope() as scope:
        # a fork starts with the thread's breadcrumbs: records logged outside any attempt's
        # scope (another run's lines, the worker's own) would reach this run's events
        scope.clear_breadcrumbs()
        for key, value in fields.items():
            scope.set_tag(f"runlane.{key}", value)
        scope.set_context("runlane", fields)
        scope.set_transaction_name(f"runlane.run {context.task_id}")
        yield
