"""The shop's tasks and its one runlane runtime, shared by the web app and the worker (run
with `flask --app shop.app runlane worker`, inside the app's context). Set DATABASE_URL
before importing it (RUNLANE_SCHEMA and SHOP_SCHEMA name the schemas, default "runlane" and
"shop")."""

from __future__ import annotations

import os
import uuid
from datetime import timedelta
from typing import Any

import attrs
from flask import current_app
from psycopg_pool import ConnectionPool

from runlane import RetryPolicy, RunContext, WaitToken, create_runlane, queue, task
from runlane.postgres import postgres_polling_lane

DATABASE_URL = os.environ["DATABASE_URL"]
RUNLANE_SCHEMA = os.environ.get("RUNLANE_SCHEMA", "runlane")
SHOP_SCHEMA = os.environ.get("SHOP_SCHEMA", "shop")
APPROVAL_TIMEOUT = timedelta(days=2)


@attrs.frozen
class FulfilOrder:
    order_id: str  # payloads are stored as JSON: strings, numbers, lists, attrs classes


@task(
    id="orders.fulfil",
    schema=FulfilOrder,
    queue="orders",
    retry=RetryPolicy(max_attempts=5),
    timeout=timedelta(minutes=1),
)
def fulfil_order(payload: FulfilOrder, context: RunContext) -> dict[str, str]:
    """Wait for a person to approve the order (a wait token), then ship it."""
    # The token's id is derived from the order, so the approval view finds the same token,
    # even when the approval arrives before this run reaches the wait.
    token_id = context.step("approval-token", lambda: str(approval_token(payload.order_id).id))
    approval = context.wait_for_token(token_id)  # suspends the run until the token completes
    context.step("ship", lambda: mark_shipped(payload.order_id, approval["approved_by"]))
    return {"order_id": payload.order_id, "approved_by": approval["approved_by"]}


def approval_token(order_id: uuid.UUID | str) -> WaitToken:
    """The order's approval token: created by the first caller, the same token afterwards."""
    return runlane.create_wait_token(
        timeout=APPROVAL_TIMEOUT, idempotency_key=f"order-approval:{order_id}"
    )


def mark_shipped(order_id: str, approved_by: str) -> None:
    # FlaskRunlane enters the app's context around every attempt: the handler uses the
    # app's own connection pool, as a view does
    pool: ConnectionPool[Any] = current_app.extensions["shop"]["pool"]
    with pool.connection() as conn:  # commits when the block ends
        conn.execute(
            "update orders set status = 'shipped', approved_by = %s where id = %s",
            (approved_by, order_id),
        )


runlane = create_runlane(
    lane=postgres_polling_lane(connection_string=DATABASE_URL, schema=RUNLANE_SCHEMA),
    queues=[queue("orders", default=True)],
    tasks=[fulfil_order],
)
