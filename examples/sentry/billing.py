"""examples/sentry: runs that fail for good reach Sentry with their traceback, tagged with
their run, each attempt in its own scope (runlane.integrations.sentry.sentry_scope).

Run `python billing.py` with SENTRY_DSN set (unset: Sentry sends nothing). It uses the
database in DATABASE_URL (schema RUNLANE_SCHEMA, default "billing"), or starts a throw-away
PostgreSQL when DATABASE_URL is unset.
"""

from __future__ import annotations

import logging
import os

import attrs
import sentry_sdk

from runlane import NonRetryableError, RetryPolicy, RunContext, Runlane, create_runlane, task
from runlane.integrations.sentry import sentry_scope
from runlane.postgres import apply_postgres_storage_migrations, postgres_polling_lane

SCHEMA = os.environ.get("RUNLANE_SCHEMA", "billing")


@attrs.frozen
class SendInvoice:
    customer: str
    amount_cents: int


@task(id="billing.send_invoice", schema=SendInvoice, retry=RetryPolicy(max_attempts=3))
def send_invoice(payload: SendInvoice, context: RunContext) -> str:
    # what a handler adds to the scope stays with this attempt's events
    sentry_sdk.set_tag("customer", payload.customer)
    if payload.amount_cents <= 0:  # fails the run for good: an ERROR record, a Sentry event
        raise NonRetryableError(f"an invoice of {payload.amount_cents} cents cannot be sent")
    if payload.customer == "flaky":  # retried: a WARNING record, a breadcrumb
        raise ConnectionError("the mail API did not answer")
    return f"sent {payload.amount_cents} cents to {payload.customer}"


def make_runlane(database_url: str) -> Runlane:
    return create_runlane(
        lane=postgres_polling_lane(connection_string=database_url, schema=SCHEMA),
        tasks=[send_invoice],
        # every attempt in its own Sentry scope, tagged runlane.run_id, runlane.task_id, ...
        middleware=[sentry_scope],
    )


if __name__ == "__main__":
    from runlane.testing import start_embedded_postgres

    logging.basicConfig(level=logging.INFO)
    # the default logging integration reports ERROR records (a run failed for good, with
    # its traceback) as events and keeps lower ones (a retried attempt) as breadcrumbs
    sentry_sdk.init(dsn=os.environ.get("SENTRY_DSN"))
    database_url = os.environ.get("DATABASE_URL") or start_embedded_postgres()[0]
    apply_postgres_storage_migrations(connection_string=database_url, schema=SCHEMA)
    runlane = make_runlane(database_url)
    runlane.trigger(send_invoice, {"customer": "ada", "amount_cents": 0})
    print(runlane.drain())
    runlane.close()
