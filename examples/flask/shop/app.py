"""The shop's web app: views trigger runs inside the request's own transaction and complete
wait tokens; FlaskRunlane runs every attempt inside the app's context.

Run it (after `flask --app shop.app init-db`) with `flask --app shop.app run`, and its worker
with `flask --app shop.app runlane worker --with-maintenance`.
"""

from __future__ import annotations

import atexit
import threading
import uuid
from typing import Any

import psycopg
from flask import Blueprint, Flask, Response, abort, current_app, g, jsonify, request
from psycopg import sql
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from runlane import RunNotFound, Services, Worker
from runlane.integrations.flask import FlaskRunlane
from runlane.postgres import apply_postgres_storage_migrations

from .tasks import (
    DATABASE_URL,
    RUNLANE_SCHEMA,
    SHOP_SCHEMA,
    approval_token,
    fulfil_order,
    runlane,
)

SHOP_TABLES = """
create table if not exists stock (
    item text primary key,
    available integer not null check (available >= 0)
);
create table if not exists orders (
    id uuid primary key,
    item text not null references stock,
    quantity integer not null check (quantity > 0),
    status text not null default 'pending',
    approved_by text,
    run_id uuid not null
);
"""


def init_db() -> None:
    """Deployment step: runlane's migrations, then the shop's own tables and stock."""
    apply_postgres_storage_migrations(connection_string=DATABASE_URL, schema=RUNLANE_SCHEMA)
    with psycopg.connect(DATABASE_URL) as conn:
        conn.execute(sql.SQL("create schema if not exists {}").format(sql.Identifier(SHOP_SCHEMA)))
        conn.execute(sql.SQL("set search_path to {}").format(sql.Identifier(SHOP_SCHEMA)))
        conn.execute(SHOP_TABLES)
        conn.execute(
            "insert into stock values ('widget', 10), ('gadget', 1) on conflict do nothing"
        )


class Background:
    """The worker and the maintenance services this process runs beside the web app."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.services: Services | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self.worker is None:
                self.worker = runlane.create_delivery_worker(concurrency=2)
                self.services = runlane.start_services()

    def close(self) -> None:
        """Stop claiming, hand unfinished runs back, stop maintenance, close the runtime."""
        with self._lock:
            if self.worker is not None:
                self.worker.close(timeout=30)
            if self.services is not None:
                self.services.close(timeout=30)
            runlane.close()


shop = Blueprint("shop", __name__)
# the app context around every attempt, and the `flask runlane ...` commands
runlane_ext = FlaskRunlane(runlane)


def create_app(*, run_background: bool = False) -> Flask:
    """The app. Its worker runs apart: `flask --app shop.app runlane worker
    --with-maintenance`. With ``run_background`` it starts a worker and the maintenance
    services in this process instead, closed at exit: that suits one small web process, not
    several (gunicorn -w 4) nor the reloader."""
    app = Flask(__name__)
    runlane_ext.init_app(app)
    pool = ConnectionPool(
        DATABASE_URL,
        kwargs={"options": f"-c search_path={SHOP_SCHEMA}"},
        min_size=1,
        max_size=5,
        open=True,
    )
    background = Background()

    def shut_down() -> None:
        background.close()
        pool.close()

    app.extensions["shop"] = {"pool": pool, "background": background, "close": shut_down}
    atexit.register(shut_down)
    if run_background:
        background.start()
    app.register_blueprint(shop)
    app.cli.command("init-db")(init_db)
    return app


def _pool() -> ConnectionPool[Any]:
    pool: ConnectionPool[Any] = current_app.extensions["shop"]["pool"]
    return pool


def db() -> psycopg.Connection[Any]:
    """The request's connection: one transaction, committed with the request."""
    if "db" not in g:
        g.db = _pool().getconn()
    conn: psycopg.Connection[Any] = g.db
    return conn


@shop.after_app_request
def commit(response: Response) -> Response:
    conn = g.pop("db", None)
    if conn is not None:
        try:
            if response.status_code < 400:
                conn.commit()  # the order and its run appear together, or not at all
            else:
                conn.rollback()
        finally:
            _pool().putconn(conn)
    return response


@shop.teardown_app_request
def roll_back(exc: BaseException | None) -> None:
    conn = g.pop("db", None)  # only left here when the view raised
    if conn is not None:
        conn.rollback()
        _pool().putconn(conn)


@shop.post("/orders")
def place_order() -> tuple[Response, int]:
    body = request.get_json(force=True)
    order_id = uuid.uuid4()
    conn = db()
    # The run is written in this request's transaction: if anything below fails, the
    # request rolls back and the run never existed.
    handle = runlane.trigger(fulfil_order, {"order_id": str(order_id)}, connection=conn)
    conn.execute(
        "insert into orders (id, item, quantity, run_id) values (%s, %s, %s, %s)",
        (order_id, body["item"], body["quantity"], handle.id),
    )
    reserved = conn.execute(
        "update stock set available = available - %s where item = %s and available >= %s",
        (body["quantity"], body["item"], body["quantity"]),
    ).rowcount
    if not reserved:
        return jsonify(error=f"not enough {body['item']} in stock"), 409  # rolled back
    return jsonify(order_id=str(order_id), run_id=str(handle.id)), 202


@shop.post("/orders/<uuid:order_id>/approve")
def approve_order(order_id: uuid.UUID) -> tuple[Response, int]:
    body = request.get_json(force=True)
    found = db().execute("select 1 from orders where id = %s", (order_id,)).fetchone()
    if found is None:
        abort(404)
    # Completing the token commits on its own; the waiting run is resumed at once.
    token = runlane.complete_wait_token(
        approval_token(order_id).id, {"approved_by": body["approved_by"]}
    )
    return jsonify(token=str(token.id), status=token.status.value), 200


@shop.get("/orders/<uuid:order_id>")
def show_order(order_id: uuid.UUID) -> Response:
    with db().cursor(row_factory=dict_row) as cur:
        order = cur.execute(
            "select id, item, quantity, status, approved_by, run_id from orders where id = %s",
            (order_id,),
        ).fetchone()
    if order is None:
        abort(404)
    try:
        run_status: str | None = runlane.get_run(order["run_id"]).status.value
    except RunNotFound:  # pruned by retention
        run_status = None
    return jsonify(
        id=str(order["id"]),
        item=order["item"],
        quantity=order["quantity"],
        status=order["status"],
        approved_by=order["approved_by"],
        run_status=run_status,
    )
