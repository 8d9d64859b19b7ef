"""examples/flask through Flask's test client on the test database: an order triggers its run
in the request's transaction (a rolled-back request leaves no run), the app's own worker runs
it, the approval view completes the wait token the run waits on, and the run finishes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from runlane import Runlane, RunStatus
from tests._flask_shop import flask_shop
from tests.helpers import wait_for_status, wait_until

flask = pytest.importorskip("flask", reason="flask is in the dev extra: pip install -e '.[dev]'")


@pytest.fixture(scope="module")
def shop(database_url: str) -> Iterator[Any]:
    """The example's ``shop`` package imported against fresh schemas, its tables created."""
    with flask_shop(database_url, "flask") as module:
        yield module


@pytest.fixture(scope="module")
def app(shop: Any) -> Iterator[Any]:
    """The app with its worker and maintenance services running; closed afterwards."""
    application = shop.create_app(run_background=True)
    try:
        yield application
    finally:
        application.extensions["shop"]["close"]()


def runs_of(shop: Any) -> int:
    rl: Runlane = shop.runlane
    return len(rl.list_runs(task="orders.fulfil", limit=1000).runs)


def test_an_order_runs_waits_for_approval_and_ships(shop: Any, app: Any) -> None:
    client = app.test_client()
    placed = client.post("/orders", json={"item": "widget", "quantity": 2})
    assert placed.status_code == 202, placed.get_json()
    order_id, run_id = placed.get_json()["order_id"], uuid.UUID(placed.get_json()["run_id"])

    # The app's worker runs it; the run suspends on the approval token.
    wait_for_status(shop.runlane, run_id, RunStatus.WAITING)
    assert client.get(f"/orders/{order_id}").get_json()["run_status"] == "waiting"

    approved = client.post(f"/orders/{order_id}/approve", json={"approved_by": "ada"})
    assert approved.get_json()["status"] == "completed"
    run = wait_for_status(shop.runlane, run_id, RunStatus.COMPLETED)
    assert run.output == {"order_id": order_id, "approved_by": "ada"}
    order = client.get(f"/orders/{order_id}").get_json()
    assert (order["status"], order["approved_by"], order["run_status"]) == (
        "shipped",
        "ada",
        "completed",
    )


def test_approval_before_the_run_waits_is_not_lost(shop: Any, app: Any) -> None:
    client = app.test_client()
    placed = client.post("/orders", json={"item": "widget", "quantity": 1}).get_json()
    client.post(f"/orders/{placed['order_id']}/approve", json={"approved_by": "bob"})
    run = wait_for_status(shop.runlane, uuid.UUID(placed["run_id"]), RunStatus.COMPLETED)
    assert run.output["approved_by"] == "bob"


def test_a_rolled_back_request_leaves_no_run(shop: Any, app: Any) -> None:
    client = app.test_client()
    before = runs_of(shop)
    refused = client.post("/orders", json={"item": "gadget", "quantity": 5})  # 1 in stock
    assert refused.status_code == 409
    assert runs_of(shop) == before, "the run was triggered in the rolled-back transaction"
    with psycopg.connect(shop.DATABASE_URL) as conn:
        conn.execute(sql.SQL("set search_path to {}").format(sql.Identifier(shop.SHOP_SCHEMA)))
        assert conn.execute("select available from stock where item = 'gadget'").fetchone() == (1,)
        assert conn.execute("select count(*) from orders where item = 'gadget'").fetchone() == (0,)
    # and a request that commits does create one
    assert client.post("/orders", json={"item": "gadget", "quantity": 1}).status_code == 202
    wait_until(lambda: runs_of(shop) == before + 1, timeout=5, what="the committed run")


def test_unknown_orders_are_404(app: Any) -> None:
    client = app.test_client()
    assert client.get(f"/orders/{uuid.uuid4()}").status_code == 404
    assert client.post(
        f"/orders/{uuid.uuid4()}/approve", json={"approved_by": "x"}
    ).status_code == (404)
