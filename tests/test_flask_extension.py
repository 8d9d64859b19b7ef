"""runlane.integrations.flask: FlaskRunlane enters the app context around every attempt,
refuses what it cannot bind, and `flask runlane ...` runs runlane's commands on the app's
runtime: driven on examples/flask in a subprocess, the way its README says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from runlane import ConfigurationError, RunContext, RunStatus, task
from tests._flask_shop import EXAMPLE, flask_shop
from tests._optional import require
from tests.conftest import RunlaneFactory

flask = require("flask")
from runlane.integrations.flask import COMMANDS, FlaskRunlane  # noqa: E402


@attrs.frozen
class Ask:
    key: str


@task(id="flask.config", schema=Ask)
def read_config(payload: Ask, context: RunContext) -> str:
    value: str = flask.current_app.config[payload.key]
    return value


def test_every_attempt_runs_inside_the_app_context(make_runlane: RunlaneFactory) -> None:
    rl = make_runlane(tasks=[read_config])
    app = flask.Flask("shop")
    app.config["GREETING"] = "hello from the app"
    ext = FlaskRunlane(rl, app)
    assert app.extensions["runlane"] is ext
    assert ext.runlane is rl
    handle = rl.trigger(read_config, {"key": "GREETING"})
    assert rl.drain().completed == 1
    assert rl.get_run(handle.id).output == "hello from the app"

    # an app factory called again binds the newest app
    newer = flask.Flask("shop")
    newer.config["GREETING"] = "from the newer app"
    ext.init_app(newer)
    handle = rl.trigger(read_config, {"key": "GREETING"})
    rl.drain()
    assert rl.get_run(handle.id).output == "from the newer app"


def test_without_the_app_context_a_handler_sees_none(make_runlane: RunlaneFactory) -> None:
    rl = make_runlane(tasks=[read_config])
    app = flask.Flask("shop")
    FlaskRunlane(app_context=False).init_app(app, runlane=rl)
    handle = rl.trigger(read_config, {"key": "GREETING"})
    rl.drain()
    run = rl.get_run(handle.id)
    assert run.status is not RunStatus.COMPLETED
    assert run.error is not None
    assert "application context" in run.error.message


def test_the_command_group_is_registered(make_runlane: RunlaneFactory) -> None:
    app = flask.Flask("shop")
    FlaskRunlane(make_runlane()).init_app(app)
    group = app.cli.commands["runlane"]
    assert isinstance(group, flask.cli.click.Group)
    assert sorted(group.commands) == sorted(COMMANDS)


def test_what_cannot_be_bound_is_refused(make_runlane: RunlaneFactory) -> None:
    rl = make_runlane()
    with pytest.raises(ConfigurationError, match="takes the Runlane create_runlane made"):
        FlaskRunlane("runlane")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="init_app takes a Flask app, got 'app'"):
        FlaskRunlane(rl).init_app("app")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="has no runtime yet"):
        FlaskRunlane().init_app(flask.Flask("shop"))
    with pytest.raises(ConfigurationError, match="app_context must be True or False"):
        FlaskRunlane(rl, app_context="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="already bound to another runtime"):
        FlaskRunlane(rl).init_app(flask.Flask("shop"), runlane=make_runlane())


@pytest.fixture(scope="module")
def shop(database_url: str) -> Iterator[Any]:
    """examples/flask's ``shop`` package on fresh schemas, its tables created."""
    with flask_shop(database_url, "flaskx") as module:
        try:
            yield module
        finally:
            module.runlane.close()


def flask_runlane(shop: Any, *args: str) -> subprocess.CompletedProcess[str]:
    """``flask --app shop.app runlane *args`` in examples/flask, as its README runs it."""
    env = {
        **os.environ,
        "DATABASE_URL": shop.DATABASE_URL,
        "RUNLANE_SCHEMA": shop.RUNLANE_SCHEMA,
        "SHOP_SCHEMA": shop.SHOP_SCHEMA,
    }
    return subprocess.run(
        [sys.executable, "-m", "flask", "--app", "shop.app", "runlane", *args],
        cwd=EXAMPLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def test_flask_runlane_commands_run_the_example_inside_its_app(shop: Any) -> None:
    app = shop.create_app()  # no worker in this process: the commands run the runs
    try:
        client = app.test_client()
        placed = client.post("/orders", json={"item": "widget", "quantity": 1})
        assert placed.status_code == 202, placed.get_json()
        order_id, run_id = placed.get_json()["order_id"], placed.get_json()["run_id"]

        drained = flask_runlane(shop, "drain")
        assert drained.returncode == 0, drained.stderr
        assert "Executed 1 run:" in drained.stdout
        assert client.get(f"/orders/{order_id}").get_json()["run_status"] == "waiting"

        client.post(f"/orders/{order_id}/approve", json={"approved_by": "ada"})
        # the handler ships through current_app's pool: only inside the app's context
        drained = flask_runlane(shop, "drain", "--queues", "orders")
        assert drained.returncode == 0, drained.stderr
        assert "1 completed" in drained.stdout
        order = client.get(f"/orders/{order_id}").get_json()
        assert (order["status"], order["run_status"]) == ("shipped", "completed")

        shown = flask_runlane(shop, "runs", "show", run_id)
        assert shown.returncode == 0, shown.stderr
        assert run_id in shown.stdout
        assert "completed" in shown.stdout
        status = flask_runlane(shop, "status", "--json")
        assert status.returncode == 0, status.stderr
        assert '"orders"' in status.stdout
        helped = flask_runlane(shop, "worker", "--help")
        assert helped.returncode == 0
        assert "--concurrency" in helped.stdout
    finally:
        app.extensions["shop"]["pool"].close()  # the runtime stays open for the module


def test_flask_runlane_worker_runs_the_example_until_sigterm(shop: Any) -> None:
    app = shop.create_app()
    env = {
        **os.environ,
        "DATABASE_URL": shop.DATABASE_URL,
        "RUNLANE_SCHEMA": shop.RUNLANE_SCHEMA,
        "SHOP_SCHEMA": shop.SHOP_SCHEMA,
    }
    argv = [sys.executable, "-m", "flask", "--app", "shop.app", "runlane", "worker"]
    try:
        with subprocess.Popen(
            [*argv, "--concurrency", "2"],
            cwd=EXAMPLE,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        ) as worker:
            try:
                client = app.test_client()
                placed = client.post("/orders", json={"item": "widget", "quantity": 1}).get_json()
                order_id, run_id = placed["order_id"], uuid.UUID(placed["run_id"])
                client.post(f"/orders/{order_id}/approve", json={"approved_by": "bob"})
                run = shop.runlane.wait_for_run(run_id, timeout=60)
                assert run.status is RunStatus.COMPLETED, run.error
                assert client.get(f"/orders/{order_id}").get_json()["status"] == "shipped"
                worker.send_signal(signal.SIGTERM)
                _, err = worker.communicate(timeout=60)
            finally:
                if worker.poll() is None:
                    worker.kill()
        assert worker.returncode == 0, err
    finally:
        app.extensions["shop"]["pool"].close()  # the runtime stays open for the module
