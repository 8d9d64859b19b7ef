"""The shop's tasks and its runlane runtime (APP ``orders.runlane_app:runlane``).

Views trigger runs on Django's own connection (:func:`django_connection`), inside
``transaction.atomic()``: a run exists only if the request's transaction commits. Workers
run with ``python manage.py runlane_worker``; every attempt is wrapped in
:func:`django_db`, which gives the handler's thread fresh Django connections as a request
does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import attrs
import psycopg
from django.conf import settings
from django.db import close_old_connections, connection

from runlane import RetryPolicy, RunContext, create_runlane, queue, task
from runlane.postgres import postgres_polling_lane


def django_connection() -> psycopg.Connection[Any]:
    """The psycopg 3 connection under Django's default database connection: inside
    ``transaction.atomic()`` a run triggered on it commits or rolls back with the block."""
    connection.ensure_connection()
    raw = connection.connection
    if not isinstance(raw, psycopg.Connection):
        raise TypeError("runlane needs Django's postgresql backend on psycopg 3")
    return raw


@contextlib.contextmanager
def django_db(context: RunContext) -> Iterator[None]:
    """Middleware: Django's per-request connection handling around every attempt (a
    connection that died or passed CONN_MAX_AGE is replaced before and after)."""
    close_old_connections()
    try:
        yield
    finally:
        close_old_connections()


@attrs.frozen
class FulfilOrder:
    order_id: int


@task(id="orders.fulfil", schema=FulfilOrder, queue="orders", retry=RetryPolicy(max_attempts=5))
def fulfil_order(payload: FulfilOrder, context: RunContext) -> dict[str, Any]:
    from orders.models import Order  # the app registry is ready once a handler runs

    order = Order.objects.get(pk=payload.order_id)
    order.status = "shipped"
    order.save(update_fields=["status"])
    return {"order_id": order.pk, "status": order.status}


runlane = create_runlane(
    lane=postgres_polling_lane(
        connection_string=settings.DATABASE_URL, schema=settings.RUNLANE_SCHEMA
    ),
    queues=[queue("orders", default=True)],
    tasks=[fulfil_order],
    middleware=[django_db],
)
