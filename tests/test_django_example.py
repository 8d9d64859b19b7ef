"""examples/django on the test database: a view triggers its run inside transaction.atomic
on Django's own psycopg 3 connection (a rolled-back request leaves no run), and
`python manage.py runlane_worker` runs it to completion and stops on SIGTERM."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from runlane import Runlane, RunStatus
from runlane.postgres import apply_postgres_storage_migrations
from tests._optional import require

django = require("django")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "django"


def module(name: str) -> Any:
    """A module of Django's or of the example's, imported once Django is set up (the
    example's models need the app registry)."""
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def site(database_url: str) -> Iterator[dict[str, str]]:
    """The example's project set up in this process on fresh schemas, migrated."""
    suffix = uuid.uuid4().hex[:12]
    env = {
        "DATABASE_URL": database_url,
        "SHOP_SCHEMA": f"django_shop_{suffix}",
        "RUNLANE_SCHEMA": f"django_rl_{suffix}",
        "DJANGO_SETTINGS_MODULE": "shopsite.settings",
    }
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("create schema {}").format(sql.Identifier(env["SHOP_SCHEMA"])))
    apply_postgres_storage_migrations(connection_string=database_url, schema=env["RUNLANE_SCHEMA"])
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        patch.syspath_prepend(str(EXAMPLE))
        try:
            django.setup()
            module("django.core.management").call_command("migrate", verbosity=0)
            yield env
        finally:
            runlane_app = sys.modules.get("orders.runlane_app")
            if runlane_app is not None:
                runlane_app.runlane.close()
            module("django.db").connections.close_all()
            with psycopg.connect(database_url, autocommit=True) as conn:
                for schema in (env["SHOP_SCHEMA"], env["RUNLANE_SCHEMA"]):
                    conn.execute(
                        sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(schema))
                    )


def runtime() -> Runlane:
    runlane: Runlane = module("orders.runlane_app").runlane
    return runlane


def run_count() -> int:
    return len(runtime().list_runs(task="orders.fulfil", limit=1000).runs)


def test_a_rolled_back_request_leaves_no_run(site: dict[str, str]) -> None:
    models = module("orders.models")
    order, stock = models.Order, models.Stock
    client = module("django.test").Client()
    before = run_count()
    refused = client.post("/orders", {"item": "gadget", "quantity": 5}, "application/json")
    assert refused.status_code == 409, refused.content
    assert run_count() == before, "the run was written outside the rolled-back transaction"
    assert order.objects.filter(item_id="gadget").count() == 0
    assert stock.objects.get(pk="gadget").available == 1

    placed = client.post("/orders", {"item": "gadget", "quantity": 1}, "application/json")
    assert placed.status_code == 202, placed.content
    run_id = uuid.UUID(placed.json()["run_id"])
    assert run_count() == before + 1
    assert runtime().get_run(run_id).status is RunStatus.QUEUED
    assert order.objects.get(pk=placed.json()["order_id"]).run_id == run_id


def test_the_management_command_runs_a_worker(site: dict[str, str]) -> None:
    client = module("django.test").Client()
    placed = client.post("/orders", {"item": "widget", "quantity": 2}, "application/json")
    assert placed.status_code == 202, placed.content
    order_id, run_id = placed.json()["order_id"], uuid.UUID(placed.json()["run_id"])
    with subprocess.Popen(
        [sys.executable, "manage.py", "runlane_worker", "--concurrency", "2"],
        cwd=EXAMPLE,
        env={**os.environ, **site},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as worker:
        try:
            run = runtime().wait_for_run(run_id, timeout=60)
            assert run.status is RunStatus.COMPLETED, run.error
            assert run.output == {"order_id": order_id, "status": "shipped"}
            worker.send_signal(signal.SIGTERM)
            _, err = worker.communicate(timeout=60)
        finally:
            if worker.poll() is None:
                worker.kill()
    assert worker.returncode == 0, err
    # issue 37: each line once (Django's LOGGING handler and the CLI's both wrote it)
    ended = [line for line in err.splitlines() if f"run {run_id} completed in" in line]
    assert len(ended) == 1, err
    assert " INFO runlane.runs: " in ended[0]  # the CLI's format, with the time and level
    shown = client.get(f"/orders/{order_id}").json()
    assert shown == {"id": order_id, "status": "shipped", "run_status": "completed"}
    assert client.get("/orders/999999").status_code == 404


def test_runs_in_the_request_transaction_share_its_fate(site: dict[str, str]) -> None:
    """Directly on Django's connection: a trigger in an atomic block that rolls back is gone;
    one in a block that commits is kept."""
    transaction = module("django.db").transaction
    app = module("orders.runlane_app")
    rl = runtime()
    with transaction.atomic():
        dropped = rl.trigger(app.fulfil_order, {"order_id": 1}, connection=app.django_connection())
        transaction.set_rollback(True)
    with transaction.atomic():
        kept = rl.trigger(app.fulfil_order, {"order_id": 2}, connection=app.django_connection())
    ids = {run.id for run in rl.list_runs(task="orders.fulfil", limit=1000).runs}
    assert kept.id in ids
    assert dropped.id not in ids
    rl.cancel(kept.id)
